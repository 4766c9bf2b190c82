"""The generator: everything that makes a bundle (rules, kernel sets, rendering, toolchains, the build
identity). It depends on the runtime package, never the reverse: the runtime imports with numpy alone."""
