"""The offline model file: write, read, verify."""

from tessel.package.format import (
    FORMAT_VERSION,
    SUFFIX,
    Manifest,
    Package,
    PackageError,
    write_package,
)

__all__ = [
    "FORMAT_VERSION",
    "SUFFIX",
    "Manifest",
    "Package",
    "PackageError",
    "write_package",
]
