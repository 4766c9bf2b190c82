"""Packs: one compressed archive (tar + gzip, standard library only) holding one or more bundles, for
shipping prebuilt kernels to other machines.

Layout of NAME.tdpack (members in this order):

    tdpack.json                         the pack manifest (below); always the first member
    tdpack.sig                          optional: an ed25519 signature over tdpack.json's bytes (signing.py)
    bundles/<bundle>/manifest.json      each bundle as `scons` wrote it, so an extracted bundle is an
    bundles/<bundle>/kernels/<name>.so  ordinary bundle directory (loadable from Python and from C++)
    models/<backend>_<arch>_<op>.json   the learned ranking models of the packed backends / arches
    tuning/<file>.json                  tuning records given to `pack --tuning`

The pack manifest lists every other member with its size and sha256, every kernel with its key, file,
sha256, backend and arch, and the toolchain of each bundle. Nothing in an archive is trusted before it
is checked against that list: extraction reads the archive once, in order, refuses any member that is
not a regular file the manifest names (absolute paths, "..", links, devices, duplicates, sizes over the
limits), checks every member's size and sha256 while writing it into a private temporary directory
inside the cache, and only then renames that directory into place. A pack is named in the cache by the
sha256 of its manifest: the manifest pins the sha256 of every file, and each kernel library is checked
against it again (bundle.read_kernel) when it is opened, so a reused cache entry is checked as a fresh
one is.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional, Union

from . import abi, bundle, learned, tuning as tuning_mod
from .caches import user_cache_dir
from .errors import BundleError

SUFFIX = ".tdpack"
FORMAT = "tiledispatch-pack"
FORMAT_VERSION = 1
PACK_MANIFEST = "tdpack.json"
SIGNATURE = "tdpack.sig"
MAX_MEMBERS = 100_000           # files in one pack (a bundle of 40,000 kernels fits twice)
MAX_MEMBER_BYTES = bundle.MAX_KERNEL_BYTES
MAX_PACK_BYTES = 64 << 30       # the sum of the members' sizes
MAX_SIGNATURE_BYTES = 4096
COMPLETE = ".complete"          # written last into an extraction; a cache entry without it is not used
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.+-]*"
_PATH = re.compile(rf"(?:bundles/{_PART}/(?:manifest\.json|kernels/{_PART}\.so)|models/{_PART}\.json"
                   rf"|tuning/{_PART}\.json)")
_NAME = re.compile(_PART)


# -- writing --------------------------------------------------------------------------------------
def create(bundle_dirs: Iterable[Union[str, Path]], output: Union[str, Path], *,
           tuning_files: Iterable[Union[str, Path]] = (), model_files: Iterable[Union[str, Path]] = (),
           sign_key: Union[str, Path, None] = None) -> dict:
    """Write a pack of the given bundle directories to `output` (atomically) and return its manifest.
    Every bundle is checked as load() checks it (manifest structure, each library's sha256 and embedded
    key) before anything is written. The runtime's learned models for the packed backends / arches are
    included, and model_files (learned models, <backend>_<arch>_<task>.json, as bench/sweeps/train.py
    writes them) instead of the runtime's of the same name; tuning_files: tuning record files to carry."""
    import tiledispatch

    output = Path(output)
    bundles = []
    small = {}  # archive path -> bytes: manifests, models, tuning records
    libraries = {}  # archive path -> (bundle directory, path in it, sha256): read again while writing
    for bdir in map(Path, bundle_dirs):
        manifest = bundle.read_manifest(bdir)
        name = bdir.resolve().name
        if not _NAME.fullmatch(name):
            raise BundleError(f"{bdir}: the bundle's directory name {name!r} cannot name it in a pack "
                              f"(letters, digits, '_', '.', '+', '-')")
        if any(b["name"] == name for b in bundles):
            raise BundleError(f"{bdir}: two bundles named {name}: a pack names its bundles by their directory "
                              f"names (rename one, scons bundle=...)")
        raw = bundle._read_regular(bdir, bundle.MANIFEST, bundle.MAX_MANIFEST_BYTES)
        if [(e.get("name"), e.get("sha256")) for e in json.loads(raw).get("kernels", [])] != \
                [(e["name"], e["sha256"]) for e in manifest["kernels"]]:
            raise BundleError(f"{bdir}: {bundle.MANIFEST} changed while it was packed (a rebuild?); pack again")
        small[f"bundles/{name}/{bundle.MANIFEST}"] = raw
        kernels = []
        for e in manifest["kernels"]:
            data = bundle.read_kernel(bdir, e)  # the same checks as load: nothing unverified is shipped
            kernels.append({"name": e["name"], "file": f"bundles/{name}/{e['file']}", "sha256": e["sha256"],
                            "size": len(data), "backend": manifest["backend"], "arch": manifest["arch"],
                            "key": e["key"], "origin": e.get("origin", "")})
            libraries[kernels[-1]["file"]] = (bdir, e["file"], e["sha256"], len(data))
        if not kernels:
            raise BundleError(f"{bdir}: the bundle has no kernels")
        bundles.append({"name": name, "backend": manifest["backend"], "arch": manifest["arch"],
                        "manifest": f"bundles/{name}/{bundle.MANIFEST}",
                        "kernel_sets": manifest.get("kernel_sets", []), "toolchain": manifest.get("toolchain", {}),
                        "host": manifest.get("host", {}), "kernels": kernels})
    if not bundles:
        raise BundleError("nothing to pack: give at least one bundle directory")
    models = []
    for path in map(Path, model_files):
        try:
            applies = json.loads(path.read_text())["applies_to"]
            backend, arch, op = applies["backend"], applies["arch"], applies["op"]
            task = op if op != "conv" else f"conv_{applies['direction']}"
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BundleError(f"--model {path}: not a learned model (JSON with applies_to backend, arch, op and, "
                              f"for conv, direction): {e}") from None
        if path.name != f"{backend}_{arch}_{task}.json" or not _NAME.fullmatch(path.name):
            raise BundleError(f"--model {path}: the model applies to {backend}/{arch} {task}: name it "
                              f"{backend}_{arch}_{task}.json")
        if any(m["file"] == f"models/{path.name}" for m in models):
            raise BundleError(f"--model {path}: two models for {backend}/{arch} {task}")
        models.append({"file": f"models/{path.name}", "backend": backend, "arch": arch, "op": op})
        small[models[-1]["file"]] = bundle._read_regular(path.parent, path.name, MAX_MEMBER_BYTES)
    for b in bundles:
        sigs = [k["key"]["signature"] for k in b["kernels"]]
        for op in sorted({s["op"] if s["op"] != "conv" else f"conv_{s['direction']}" for s in sigs}):
            path = learned.model_path(b["backend"], b["arch"], op)
            rel = f"models/{path.name}"
            if path.is_file() and rel not in small:
                models.append({"file": rel, "backend": b["backend"], "arch": b["arch"], "op": op})
                small[rel] = bundle._read_regular(path.parent, path.name, MAX_MEMBER_BYTES)
    tuning = []
    for path in map(Path, tuning_files):
        rel = f"tuning/{path.name}"
        if not _NAME.fullmatch(path.name) or not path.name.endswith(".json") or rel in small:
            raise BundleError(f"--tuning {path}: a tuning file needs a plain, distinct name ending in .json")
        count = sum(len(records) for records in tuning_mod.TuningCache(path).records().values())
        if not count:
            raise BundleError(f"--tuning {path}: no tuning records (a missing file, or not a tiledispatch tuning "
                              f"cache of schema {tuning_mod.SCHEMA})")
        tuning.append({"file": rel, "records": count})
        small[rel] = bundle._read_regular(path.parent, path.name, MAX_MEMBER_BYTES)

    files = {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in small.items()}
    files.update({rel: {"size": size, "sha256": digest} for rel, (_, _, digest, size) in libraries.items()})
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "abi_version": abi.ABI_VERSION,
        "generator": {"name": "tiledispatch", "version": tiledispatch.__version__},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "bundles": bundles, "models": models, "tuning": tuning, "files": dict(sorted(files.items())),
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    members = [(PACK_MANIFEST, lambda: manifest_bytes)]
    if sign_key is not None:
        from . import signing

        signature = signing.sign(manifest_bytes, sign_key)
        members.append((SIGNATURE, lambda: signature))

    def library(rel: str):
        def read() -> bytes:  # the bytes packed are the bytes checked (a rebuild may run meanwhile)
            bdir, file, digest, _ = libraries[rel]
            data = bundle._read_regular(bdir, file, MAX_MEMBER_BYTES)
            if hashlib.sha256(data).hexdigest() != digest:
                raise BundleError(f"{bdir / file} changed while it was packed (a rebuild?); pack again")
            return data
        return read

    for rel in sorted(files):
        members.append((rel, library(rel) if rel in libraries else (lambda data=small[rel]: data)))
    _write_archive(output, members)
    return manifest


def _write_archive(output: Path, members: list) -> None:
    """A gzip-compressed ustar/pax archive of regular files, (name, a function returning the bytes) each,
    called one at a time (one library in memory at once), written to a temporary file beside output and
    renamed over it. Owners, modes and times are fixed: the archive's bytes depend on the contents only."""
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, read in members:
                data = read()
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- reading --------------------------------------------------------------------------------------
def cache_root() -> Path:
    """$TD_PACK_CACHE, else $XDG_CACHE_HOME/tiledispatch/packs, else ~/.cache/tiledispatch/packs."""
    return user_cache_dir("TD_PACK_CACHE", "packs")


class Pack:
    """An opened pack: its manifest (checked), where it is extracted, and whether it was extracted now."""

    def __init__(self, source: Path, manifest: dict, digest: str, root: Path, extracted: bool,
                 signed_by: Optional[str]):
        self.source, self.manifest, self.digest, self.root = source, manifest, digest, root
        self.extracted, self.signed_by = extracted, signed_by

    def bundle_dir(self, entry: dict) -> Path:
        return self.root / "bundles" / entry["name"]


def open_pack(path: Union[str, Path], *, trust=None, cache: Optional[Path] = None) -> Pack:
    """Check the pack at `path` (manifest; the signature when trust= is given) and extract it into the
    cache unless an earlier extraction of the same manifest is there. trust: the public key (see
    signing.public_key) the pack must be signed with; unsigned or otherwise signed packs are refused."""
    path = Path(path)
    root = Path(cache) if cache is not None else cache_root()
    with _archive(path) as (tar, budget):
        manifest_bytes, manifest = _read_manifest(path, tar, budget)
        digest = hashlib.sha256(manifest_bytes).hexdigest()
        signature, first = _read_signature(path, tar)
        signed_by = None
        if trust is not None:
            from . import signing

            signed_by = signing.verify(manifest_bytes, signature, trust, what=str(path))
        target = root / digest
        if (target / COMPLETE).is_file():
            if signed_by is not None:
                _keep_signature(target, signature)
            return Pack(path, manifest, digest, target, False, signed_by)
        _extract(path, tar, first, manifest, manifest_bytes, signature, root, target)
    return Pack(path, manifest, digest, target, True, signed_by)


class _Budget:
    """The decompressed stream tarfile reads, refusing to deliver more bytes than `limit`: a gzip bomb (a
    small archive that expands to far more than its manifest declares, e.g. inside a pax header, which
    tarfile reads whole into memory) stops at the limit instead of filling memory or disk."""

    def __init__(self, raw, path: Path, limit: int):
        self.raw, self.path, self.limit, self.used = raw, path, limit, 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.used += len(data)
        if self.used > self.limit:
            raise BundleError(f"{self.path}: the archive expands to more than the {self.limit} bytes its manifest "
                              f"accounts for (a damaged or hostile archive)")
        return data


def _overhead(files: int) -> int:
    """Bytes of tar headers and padding an archive of `files` members may hold besides their contents:
    per member a header, a pax header (long names) and padding, generously; the end-of-archive blocks."""
    return (files + 2) * (64 << 10)


def _keep_signature(target: Path, signature: bytes) -> None:
    """A cache entry extracted from an unsigned copy of this pack gets the verified signature (the C++
    loader checks it there); written atomically, never through a link."""
    current = target / SIGNATURE
    try:
        if current.is_file() and not current.is_symlink() and current.read_bytes() == signature:
            return
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".sig.")
        with os.fdopen(fd, "wb") as f:
            f.write(signature)
        os.chmod(tmp, 0o444)
        os.replace(tmp, current)
    except OSError:  # a read-only cache: the Python runtime checked the signature anyway
        pass


@contextlib.contextmanager
def _archive(path: Path):
    """The archive opened as a stream (members strictly in order, nothing seeks back), with the budget of
    decompressed bytes first set for the manifest alone (_read_manifest raises it to what the manifest lists)."""
    try:
        f = open(path, "rb")
    except IsADirectoryError:
        raise BundleError(f"{path}: a directory, not a pack") from None
    except OSError as e:
        raise BundleError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        budget = _Budget(gzip.GzipFile(fileobj=f, mode="rb"), path,
                         bundle.MAX_MANIFEST_BYTES + MAX_SIGNATURE_BYTES + _overhead(2))
        try:
            tar = tarfile.open(fileobj=budget, mode="r|")
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise BundleError(f"{path}: not a tiledispatch pack (a gzip-compressed tar archive): {e}") from None
        with tar:
            try:
                yield tar, budget
            except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise BundleError(f"{path}: the archive is damaged or truncated: {e}") from None
            except OSError as e:
                raise BundleError(f"{path}: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from None
    finally:
        f.close()


def _next_member(path: Path, tar: tarfile.TarFile) -> Optional[tarfile.TarInfo]:
    try:
        return tar.next()
    except tarfile.ReadError as e:
        raise BundleError(f"{path}: the archive is damaged or truncated: {e}") from None


def check_member(path: Path, info: tarfile.TarInfo) -> None:
    """Refuse a member that could write anything but a plain file below the extraction directory."""
    name = info.name
    where = f"{path}: member {name[:200]!r}"
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise BundleError(f"{where}: an absolute path; a pack holds relative paths only")
    if ".." in name.replace("\\", "/").split("/"):
        raise BundleError(f"{where}: a '..' path component; nothing in a pack may point outside it")
    if info.issym() or info.islnk():
        raise BundleError(f"{where}: a {'symbolic' if info.issym() else 'hard'} link (to {info.linkname[:200]!r}); "
                          f"a pack holds regular files only")
    if info.isdev() or info.isfifo():
        raise BundleError(f"{where}: a device or FIFO; a pack holds regular files only")
    if not info.isreg() or info.issparse():
        raise BundleError(f"{where}: not a regular file (type {info.type!r}); a pack holds regular files only")
    if info.size > MAX_MEMBER_BYTES:
        raise BundleError(f"{where}: {info.size} bytes, larger than the limit of {MAX_MEMBER_BYTES}")


def _read_member(path: Path, tar: tarfile.TarFile, info: tarfile.TarInfo, limit: int) -> bytes:
    if info.size > limit:
        raise BundleError(f"{path}: {info.name} is {info.size} bytes, larger than the limit of {limit}")
    data = tar.extractfile(info).read()
    if len(data) != info.size:
        raise BundleError(f"{path}: {info.name}: the archive is truncated")
    return data


def _read_manifest(path: Path, tar: tarfile.TarFile, budget: _Budget) -> tuple[bytes, dict]:
    info = _next_member(path, tar)
    if info is None:
        raise BundleError(f"{path}: an empty archive, not a tiledispatch pack")
    check_member(path, info)
    if info.name != PACK_MANIFEST:
        raise BundleError(f"{path}: the first member is {info.name[:200]!r}, not {PACK_MANIFEST}: not a tiledispatch "
                          f"pack")
    data = _read_member(path, tar, info, bundle.MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BundleError(f"{path}: {PACK_MANIFEST}: not valid JSON: {e}") from None
    check_manifest(path, manifest)
    files = manifest["files"]
    budget.limit = budget.used + sum(f["size"] for f in files.values()) + MAX_SIGNATURE_BYTES \
        + _overhead(len(files))
    return data, manifest


def _read_signature(path: Path, tar: tarfile.TarFile) -> tuple[Optional[bytes], Optional[tarfile.TarInfo]]:
    """The signature member when it is the second member (else None), and the first member after it."""
    info = _next_member(path, tar)
    if info is None or info.name != SIGNATURE:
        return None, info
    check_member(path, info)
    data = _read_member(path, tar, info, MAX_SIGNATURE_BYTES)
    return data, _next_member(path, tar)


def check_manifest(path: Path, m) -> None:
    """The pack manifest's structure: a BundleError naming the first thing that is wrong."""
    where = f"{path}: {PACK_MANIFEST}"

    def need(cond: bool, why: str):
        if not cond:
            raise BundleError(f"{where}: {why}")

    need(isinstance(m, dict), "expected a JSON object")
    need(m.get("format") == FORMAT,
         f"format {str(m.get('format'))[:80]!r}, expected {FORMAT!r}: not a tiledispatch pack")
    version = m.get("format_version")
    need(type(version) is int and version == FORMAT_VERSION,
         f"pack format version {version!r}; this runtime reads version {FORMAT_VERSION}")
    need(m.get("abi_version") == abi.ABI_VERSION,
         f"its kernels use ABI version {m.get('abi_version')!r}, this runtime ABI version {abi.ABI_VERSION}")
    files = m.get("files")
    need(isinstance(files, dict) and 0 < len(files) <= MAX_MEMBERS, f"'files' must list 1 to {MAX_MEMBERS} files")
    total = 0
    for rel, f in files.items():
        need(bool(_PATH.fullmatch(rel)), f"file {rel[:200]!r} is not a path a pack may hold")
        need(isinstance(f, dict) and type(f.get("size")) is int and 0 <= f["size"] <= MAX_MEMBER_BYTES
             and isinstance(f.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", f["sha256"]) is not None,
             f"file {rel}: needs a size (at most {MAX_MEMBER_BYTES}) and a sha256 (64 lower-case hex digits)")
        total += f["size"]
    need(total <= MAX_PACK_BYTES, f"its files hold {total} bytes, more than the limit of {MAX_PACK_BYTES}")
    bundles = m.get("bundles")
    need(isinstance(bundles, list) and bundles, "'bundles' must be a non-empty list")
    names = set()
    for i, b in enumerate(bundles):
        need(isinstance(b, dict) and isinstance(b.get("name"), str) and _NAME.fullmatch(b["name"]) is not None
             and b["name"] not in names, f"bundles[{i}]: needs a distinct plain 'name'")
        names.add(b["name"])
        need(isinstance(b.get("backend"), str) and isinstance(b.get("arch"), str),
             f"bundles[{i}]: needs 'backend' and 'arch'")
        need(b.get("manifest") == f"bundles/{b['name']}/{bundle.MANIFEST}" and b["manifest"] in files,
             f"bundles[{i}]: 'manifest' must be bundles/{b['name']}/{bundle.MANIFEST}, listed in 'files'")
        kernels = b.get("kernels")
        need(isinstance(kernels, list) and kernels, f"bundles[{i}]: 'kernels' must be a non-empty list")
        for j, k in enumerate(kernels):
            need(isinstance(k, dict) and isinstance(k.get("name"), str) and isinstance(k.get("key"), dict)
                 and k.get("file") == f"bundles/{b['name']}/kernels/{k['name']}.so" and k["file"] in files
                 and k.get("sha256") == files[k["file"]]["sha256"]
                 and (k.get("backend"), k.get("arch")) == (b["backend"], b["arch"]),
                 f"bundles[{i}].kernels[{j}]: needs name, key, file (bundles/{b['name']}/kernels/<name>.so, listed in "
                 f"'files' with the same sha256), backend and arch of its bundle")
    for field in ("models", "tuning"):
        entries = m.get(field, [])
        need(isinstance(entries, list) and all(isinstance(e, dict) and e.get("file") in files for e in entries),
             f"'{field}' must be a list of objects whose 'file' is listed in 'files'")


def _extract(path: Path, tar: tarfile.TarFile, info: Optional[tarfile.TarInfo], manifest: dict,
             manifest_bytes: bytes, signature: Optional[bytes], root: Path, target: Path) -> None:
    """Extract every member into a temporary directory under root, checking each against the manifest,
    then rename it to target. When another process renamed its extraction first, that one is kept."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".extract-{target.name[:16]}-"))
    try:
        files = manifest["files"]
        seen = set()
        while info is not None:
            check_member(path, info)
            if info.name in (PACK_MANIFEST, SIGNATURE):
                raise BundleError(f"{path}: member {info.name} appears twice or out of place")
            if info.name in seen:
                raise BundleError(f"{path}: member {info.name[:200]!r} appears twice")
            want = files.get(info.name)
            if want is None:
                raise BundleError(f"{path}: member {info.name[:200]!r} is not listed in {PACK_MANIFEST}")
            if info.size != want["size"]:
                raise BundleError(f"{path}: member {info.name} is {info.size} bytes, {PACK_MANIFEST} says "
                                  f"{want['size']}: the pack was changed after it was made")
            seen.add(info.name)
            _write_member(path, tar, info, tmp / info.name, want["sha256"])
            info = _next_member(path, tar)
        missing = sorted(set(files) - seen)
        if missing:
            raise BundleError(f"{path}: {len(missing)} file(s) listed in {PACK_MANIFEST} are missing from the "
                              f"archive (truncated?), first {missing[0]}")
        _check_bundle_manifests(path, manifest, tmp)
        (tmp / PACK_MANIFEST).write_bytes(manifest_bytes)
        if signature is not None:
            (tmp / SIGNATURE).write_bytes(signature)
        (tmp / COMPLETE).write_text("")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / COMPLETE).is_file():  # not another extraction of the same pack
                if target.exists():  # a broken entry (crash mid-copy by hand, a partial delete): set it aside
                    os.rename(target, root / f".stale-{target.name[:16]}-{os.getpid()}-{time.monotonic_ns()}")
                    os.rename(tmp, target)
                    return
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race: its copy is identical
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_member(path: Path, tar: tarfile.TarFile, info: tarfile.TarInfo, dest: Path, sha256: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    src = tar.extractfile(info)
    with open(dest, "xb") as out:  # "x": never through something already there
        written = 0
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
            written += len(chunk)
    if written != info.size:
        raise BundleError(f"{path}: member {info.name}: the archive is truncated")
    if h.hexdigest() != sha256:
        raise BundleError(f"{path}: member {info.name} has sha256 {h.hexdigest()[:16]}..., {PACK_MANIFEST} says "
                          f"{sha256[:16]}...: the pack was changed after it was made")
    os.chmod(dest, 0o444 if dest.suffix != ".so" else 0o555)


def _check_bundle_manifests(path: Path, manifest: dict, tmp: Path) -> None:
    """Each extracted bundle's own manifest agrees with the pack manifest: same backend, arch and kernels
    (names, keys, files, sha256), so that the bundle directory loads as the pack says it does."""
    for b in manifest["bundles"]:
        own = bundle.read_manifest(tmp / "bundles" / b["name"])
        mine = {(k["name"], k["sha256"], f"bundles/{b['name']}/{k['file']}", bundle._canonical(k["key"]))
                for k in own["kernels"]}
        packed = {(k["name"], k["sha256"], k["file"], bundle._canonical(k["key"])) for k in b["kernels"]}
        if (own["backend"], own["arch"]) != (b["backend"], b["arch"]) or mine != packed:
            raise BundleError(f"{path}: bundle {b['name']}: its manifest.json and {PACK_MANIFEST} list different "
                              f"kernels; the pack was changed after it was made")
