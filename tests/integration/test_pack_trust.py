"""Signed packs (signing.py): ed25519 over the pack manifest with a key the user owns; load(..., trust=KEY)
refuses unsigned, otherwise signed and tampered packs with a clear error and extracts nothing."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

import tiledispatch as td
from tiledispatch import pack, signing
from test_pack import (bundles, cache, check_gemm, good_pack, members_of,  # noqa: F401
                       nothing_left, regular, write_members)

pytest.importorskip("cryptography")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("keys")
    private, public, key_id = signing.keygen(root / "mine")
    other, other_public, other_id = signing.keygen(root / "other")
    return {"private": private, "public": public, "id": key_id, "other": other, "other_public": other_public,
            "other_id": other_id}


@pytest.fixture(scope="module")
def signed(bundles, keys, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("signed") / "signed.tdpack"
    pack.create([bundles["native"]], out, sign_key=keys["private"])
    return out


def outside(tmp_path, cache):  # noqa: F811
    return {p for p in tmp_path.rglob("*") if cache not in p.parents and p != cache}


def test_keygen_writes_a_private_key_only_its_owner_reads(keys):
    assert stat.S_IMODE(os.stat(keys["private"]).st_mode) == 0o600
    assert b"PUBLIC KEY" in keys["public"].read_bytes() and b"PRIVATE KEY" in keys["private"].read_bytes()
    with pytest.raises(td.BundleError, match="exists: keygen never overwrites a key"):
        signing.keygen(keys["private"])


def test_signed_pack_loads_with_its_key(signed, keys, cache):  # noqa: F811
    for trust in (keys["public"], str(keys["public"]), keys["public"].read_text(), keys["public"].read_bytes()):
        reg = td.load(signed, trust=trust)
        assert reg.manifest["pack"]["signed_by"] == keys["id"]
    check_gemm(reg)
    assert td.load(signed).manifest["pack"]["signed_by"] is None  # without trust=, the signature is not asked for


def test_wrong_key_is_refused(signed, keys, cache, tmp_path):  # noqa: F811
    before = outside(tmp_path, cache)
    with pytest.raises(td.BundleError, match=f"signed by key {keys['id']}, not by the trusted key {keys['other_id']}"):
        td.load(signed, trust=keys["other_public"])
    nothing_left(tmp_path, cache, before)


def test_unsigned_pack_is_refused_when_trust_is_given(good_pack, keys, cache, tmp_path):  # noqa: F811
    before = outside(tmp_path, cache)
    with pytest.raises(td.BundleError, match=f"not signed, and trust= requires a signature by key {keys['id']}"):
        td.load(good_pack, trust=keys["public"])
    nothing_left(tmp_path, cache, before)


def test_a_manifest_changed_after_signing_is_refused(signed, keys, cache, tmp_path):  # noqa: F811
    members = members_of(signed)
    head = json.loads(members[0][1])
    head["created"] = "2000-01-01T00:00:00+00:00"
    bad = write_members(tmp_path / "changed.tdpack", [regular(pack.PACK_MANIFEST, json.dumps(head).encode())]
                        + members[1:])
    before = outside(tmp_path, cache)
    with pytest.raises(td.BundleError, match="the signature does not match the manifest"):
        td.load(bad, trust=keys["public"])
    nothing_left(tmp_path, cache, before)


def test_signature_is_checked_when_the_pack_is_already_cached(signed, keys, cache, tmp_path):  # noqa: F811
    td.load(signed)  # extracted, no trust asked
    stripped = write_members(tmp_path / "stripped.tdpack", [m for m in members_of(signed)
                                                            if m[0].name != pack.SIGNATURE])
    with pytest.raises(td.BundleError, match="not signed"):
        td.load(stripped, trust=keys["public"])  # same manifest, same cache entry: still refused


def test_a_verified_signature_joins_an_entry_extracted_unsigned(signed, keys, cache, tmp_path):  # noqa: F811
    stripped = write_members(tmp_path / "stripped.tdpack", [m for m in members_of(signed)
                                                            if m[0].name != pack.SIGNATURE])
    entry = pack.open_pack(stripped).root
    assert not (entry / pack.SIGNATURE).exists()
    again = pack.open_pack(signed, trust=keys["public"])
    assert again.root == entry and not again.extracted
    assert (entry / pack.SIGNATURE).read_bytes() == members_of(signed)[1][1]


def test_malformed_signature_and_bad_keys(signed, keys, cache, tmp_path):  # noqa: F811
    members = [(i, b"{not json" if i.name == pack.SIGNATURE else d) for i, d in members_of(signed)]
    for info, data in members:
        info.size = len(data)
    with pytest.raises(td.BundleError, match="signature member is malformed"):
        td.load(write_members(tmp_path / "garbled.tdpack", members), trust=keys["public"])
    with pytest.raises(td.BundleError, match="not an ed25519 public key"):
        td.load(signed, trust=b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(td.BundleError, match="the public key cannot be read"):
        td.load(signed, trust=tmp_path / "no_such_key.pub")
    with pytest.raises(td.BundleError, match="not an unencrypted PEM private key"):
        signing.sign(b"{}", keys["public"])


def test_without_cryptography_the_error_names_the_extra(signed, keys, cache, monkeypatch):  # noqa: F811
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import cryptography now raises ImportError
    with pytest.raises(td.BundleError, match=r"pip install 'tiledispatch\[sign\]'"):
        td.load(signed, trust=keys["public"])
    with pytest.raises(td.BundleError, match=r"pip install 'tiledispatch\[sign\]'"):
        signing.keygen(keys["private"].with_name("never"))


def test_cli_keygen_sign_and_trust(bundles, tmp_path):  # noqa: F811
    from test_pack import REPO, cli

    env = {"TD_PACK_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "runtime")}
    code, made = cli("keygen", tmp_path / "k", env=env)
    assert code == 0 and made["public_key"] == str(tmp_path / "k.pub"), made
    code, report = cli("pack", bundles["native"], "-o", tmp_path / "s.tdpack", "--sign", tmp_path / "k", env=env)
    assert code == 0 and report["signed"], report
    code, listing = cli("list", tmp_path / "s.tdpack", "--trust", tmp_path / "k.pub", env=env)
    assert code == 0 and len(listing["kernels"]) == 2, listing
    cli("keygen", tmp_path / "k2", env=env)
    code, err = cli("list", tmp_path / "s.tdpack", "--trust", tmp_path / "k2.pub", env=env)
    assert code == 2 and "not by the trusted key" in err["message"], err
