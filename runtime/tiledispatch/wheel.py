"""A pip-installable wheel that carries one pack, so that `td.load(NAME)` finds it after `pip install`.

The wheel holds a package tiledispatch_pack_<name> with NAME.tdpack beside its __init__.py (PACK is the
pack's path), and registers it in the entry point group tiledispatch.packs under NAME; loader.installed_pack
locates the package from that entry point without importing it. The wheel is written here directly (the
format is a zip with a dist-info directory: METADATA, WHEEL, entry_points.txt and RECORD with sha256 of
every file), so building one needs no build backend.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Union

from . import pack as pack_mod
from .errors import BundleError
from .loader import ENTRY_POINT_GROUP

_PACK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _platform_tag(manifest: dict) -> str:
    """linux_<machine> when every bundle was built on one Linux machine type (the kernels are native code),
    else any."""
    hosts = {(b.get("host", {}).get("system"), b.get("host", {}).get("machine")) for b in manifest["bundles"]}
    if len(hosts) == 1:
        system, machine = next(iter(hosts))
        if system == "Linux" and machine and re.fullmatch(r"[A-Za-z0-9_]+", machine):
            return f"linux_{machine}"
    return "any"


def build(pack_path: Union[str, Path], output_dir: Union[str, Path] = ".", *, name: Optional[str] = None,
          version: str = "1.0.0") -> Path:
    """Write the wheel for pack_path into output_dir and return its path. The pack is checked first
    (opened and extracted as load does), so a damaged pack never becomes a wheel."""
    import tiledispatch

    pack_path = Path(pack_path)
    name = name or (pack_path.name[:-len(pack_mod.SUFFIX)] if pack_path.name.endswith(pack_mod.SUFFIX)
                    else pack_path.stem)
    if not _PACK_NAME.fullmatch(name):
        raise BundleError(f"wheel: the pack name {name!r} must start with a letter or digit and hold only letters, "
                          f"digits, '_', '.' and '-' (give --name)")
    if not _VERSION.fullmatch(version):
        raise BundleError(f"wheel: version {version!r} must be numbers separated by dots")
    manifest = pack_mod.open_pack(pack_path).manifest
    data = pack_path.read_bytes()
    module = "tiledispatch_pack_" + re.sub(r"[^A-Za-z0-9_]", "_", name).lower()
    dist = module  # a distribution name that is already normalized
    info = f"{dist}-{version}.dist-info"
    bundles = ", ".join(f"{b['backend']}/{b['arch']} ({len(b['kernels'])} kernels)" for b in manifest["bundles"])
    files = {
        f"{module}/__init__.py": (f'"""The tiledispatch pack {name}: td.load("{name}") loads it."""\n'
                                  f"from pathlib import Path\n\n"
                                  f"PACK = Path(__file__).with_name({name + pack_mod.SUFFIX!r})\n").encode(),
        f"{module}/{name}{pack_mod.SUFFIX}": data,
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                             f"Summary: tiledispatch kernel pack {name}: {bundles}\n"
                             f"Requires-Dist: tiledispatch>={tiledispatch.__version__}\n").encode(),
        f"{info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: tiledispatch {tiledispatch.__version__}\n"
                          f"Root-Is-Purelib: false\nTag: py3-none-{_platform_tag(manifest)}\n").encode(),
        f"{info}/entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n{name} = {module}:PACK\n".encode(),
    }
    record = "".join(f"{path},{_record_hash(body)},{len(body)}\n" for path, body in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    target = output_dir / f"{dist}-{version}-py3-none-{_platform_tag(manifest)}.whl"
    fd, tmp = tempfile.mkstemp(dir=output_dir, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(raw, "w") as zf:
            for path, body in files.items():
                entry = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
                entry.external_attr = 0o644 << 16
                entry.compress_type = zipfile.ZIP_STORED if path.endswith(pack_mod.SUFFIX) else zipfile.ZIP_DEFLATED
                zf.writestr(entry, body)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target
