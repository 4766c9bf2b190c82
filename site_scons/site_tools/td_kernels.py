"""SCons tool entry point; the builders live in site_scons/td_build.py."""
from td_build import exists, generate  # noqa: F401
