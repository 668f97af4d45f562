"""Which Python distributions a run on the GPU machine must carry as wheels, and at which versions.

The GPU machine reaches no network, so `make install` cannot run there; its image already holds torch, Lightning,
transformers and most of what the project needs (scripts/gpu_image_packages.txt). The rest is pyproject.toml's
runtime requirements that the image lacks, followed through their own requirements (read from the distributions
installed here, markers evaluated for CPython 3.12 on Linux x86-64, the machine's interpreter), pinned to the
versions installed here: the ones the test suite ran against.

    python scripts/gpu_packages.py              # NAME==VERSION per line, what scripts/gpu_wheels.sh downloads
    python scripts/gpu_packages.py --explain    # and why each is needed

Nothing here imports the project: it reads pyproject.toml and package metadata only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "scripts" / "gpu_image_packages.txt"
# The GPU machine's interpreter, for evaluating requirement markers (`; python_version < "3.11"` and the like).
TARGET_ENVIRONMENT = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}


@dataclass(frozen=True)
class Carried:
    """A distribution the GPU machine lacks: its pinned version and the requirement that pulled it in."""

    name: str
    version: str
    needed_by: str  # "pyproject.toml" or the carried distribution whose requirement named it


def read_image(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """The image's distributions: canonical name -> version, or None where the listing gave none."""
    image: dict[str, str | None] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not name.strip() or (_ and not version.strip()):
            raise ValueError(f"{path}:{number}: {line!r} is not NAME or NAME==VERSION")
        image[canonicalize_name(name.strip())] = version.strip() or None
    return image


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """``[project].dependencies`` of pyproject.toml, those whose markers hold on the GPU machine."""
    requirements = [Requirement(text) for text in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    return [r for r in requirements if _applies(r)]


def _applies(requirement: Requirement, extra: str = "") -> bool:
    """Whether the requirement holds on the GPU machine; ``extra``: the extra it was asked for under, if any."""
    return requirement.marker is None or requirement.marker.evaluate({**TARGET_ENVIRONMENT, "extra": extra})


def _installed_requirements(name: str) -> list[Requirement]:
    return [Requirement(text) for text in importlib.metadata.requires(name) or []]


def carried_packages(
    requirements: list[Requirement],
    image: dict[str, str | None],
    installed_version: Callable[[str], str] = importlib.metadata.version,
    requirements_of: Callable[[str], list[Requirement]] = _installed_requirements,
) -> list[Carried]:
    """What must travel: every requirement not in the image, and theirs in turn, at the installed versions.

    Raises ValueError when the image holds a listed version outside a requirement's range (the image cannot run
    the project then, whatever travels), or when an installed version falls outside a requirement that names it.
    """
    carried: dict[str, Carried] = {}
    followed: set[tuple[str, str]] = set()  # (distribution, extra) pairs whose own requirements are queued
    pending = [(r, "pyproject.toml") for r in requirements if _applies(r)]
    while pending:
        requirement, needed_by = pending.pop(0)
        name = canonicalize_name(requirement.name)
        if name in image:
            listed = image[name]
            if listed is not None and not requirement.specifier.contains(Version(listed), prereleases=True):
                raise ValueError(
                    f"the GPU image has {name}=={listed}, outside {requirement} (required by {needed_by}): "
                    "the project cannot run on that image"
                )
            continue
        version = installed_version(name)
        if not requirement.specifier.contains(Version(version), prereleases=True):
            raise ValueError(f"{name}=={version} is installed here, outside {requirement} (required by {needed_by})")
        carried.setdefault(name, Carried(name, version, needed_by))
        for extra in ("", *sorted(requirement.extras)):
            if (name, extra) not in followed:
                followed.add((name, extra))
                pending.extend((r, name) for r in requirements_of(name) if _applies(r, extra))
    return sorted(carried.values(), key=lambda c: c.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="say which requirement pulled each package in")
    args = parser.parse_args()
    try:
        carried = carried_packages(project_requirements(), read_image())
    except (ValueError, importlib.metadata.PackageNotFoundError) as error:
        sys.exit(f"error: {error}")
    for package in carried:
        print(f"{package.name}=={package.version}" + (f"  # needed by {package.needed_by}" if args.explain else ""))


if __name__ == "__main__":
    main()
