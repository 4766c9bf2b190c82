# Make the runtime package importable from the build without installing it.
import sys

from SCons.Script import Dir

sys.path.insert(0, Dir("#runtime").abspath)
