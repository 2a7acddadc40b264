"""The `Patch` record every file in this package defines, and the version checks."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class PatchError(RuntimeError):
    """A patch cannot be applied: wrong megatron-core version or upstream code changed under it."""


def megatron_core_version() -> Version:
    """Installed megatron-core version."""
    return Version(importlib.metadata.version("megatron-core"))


@dataclass(frozen=True)
class Patch:
    """One runtime patch of megatron-core (or of torch as megatron-core uses it).

    Attributes:
        name: short identifier (also used to skip a patch in tests).
        fixes: what breaks without it.
        verified: megatron-core versions this patch was verified against.
        fixed_in: first megatron-core version where upstream fixed the problem (patch skipped there).
        needed_when: "cpu" (torch without CUDA), "no_te" (TransformerEngine not importable),
            "always".
        check: raises PatchError when the upstream code the patch targets is not as expected.
        apply: performs the patch (called once per process).
        speed_only: nothing fails without it; it replaces a slow upstream path with an
            equivalent one (tested for equal results instead of for a failure).
    """

    name: str
    fixes: str
    verified: SpecifierSet
    needed_when: str
    check: Callable[[], None]
    apply: Callable[[], None]
    fixed_in: Version | None = None
    speed_only: bool = False

    def decide(self, version: Version, *, cpu: bool, have_te: bool) -> str:
        """'apply', or the reason it is skipped; raises PatchError when it must but cannot apply."""
        if self.needed_when == "cpu" and not cpu:
            return "skipped: CUDA is available"
        if self.needed_when == "no_te" and have_te:
            return "skipped: TransformerEngine is installed"
        if self.fixed_in is not None and version >= self.fixed_in:
            return f"skipped: fixed upstream in megatron-core {self.fixed_in}"
        if version not in self.verified:
            raise PatchError(
                f"patch {self.name!r} ({self.fixes}) is verified for megatron-core {self.verified}, "
                f"but {version} is installed; install a megatron-core in the range pyproject.toml pins "
                "or re-verify the patch (tests/patches/)"
            )
        self.check()
        return "apply"


def require(condition: bool, patch: str, what: str) -> None:
    """Raise PatchError naming the patch when an upstream anchor is not as expected."""
    if not condition:
        raise PatchError(f"patch {patch!r}: upstream changed: {what}")
