"""The wheel's one platform detail, beside pyproject.toml's metadata: when libmoe.so has been
placed inside the package (scripts/python-wheel.sh does that), the wheel carries it and is
tagged for this platform (py3-none-<platform>: ctypes loads the library, so any Python 3 on
the platform can use it); without it the package is the pure-Python bindings alone."""
import glob
import os

from setuptools import Distribution, setup

try:  # setuptools >= 70.1 has its own; before, the wheel package provides it
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED = glob.glob(os.path.join(HERE, "libmoe", "libmoe.so*"))


class PlatformDistribution(Distribution):
    def has_ext_modules(self):  # a native library inside: the wheel is for this platform
        return bool(BUNDLED)


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        python, abi, platform = super().get_tag()
        return ("py3", "none", platform) if BUNDLED else (python, abi, platform)


setup(distclass=PlatformDistribution, cmdclass={"bdist_wheel": PlatformWheel},
      package_data={"libmoe": [os.path.basename(p) for p in BUNDLED]})
