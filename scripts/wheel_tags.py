"""Installed packages whose wheel was built for another Python minor version.

Used by scripts/pip_install.sh after uv installs; standard library only.

    python scripts/wheel_tags.py       # stdout: NAME==VERSION, one a line

A few pure-Python projects ship one wheel per Python version (multiprocess: ``py310-none-any``,
``py311-none-any``, ...), because their code follows that version's standard library. Every such
tag is "compatible" with a newer interpreter, and pip takes the one for the running version
wherever it is; uv 0.13.9 can take an older one from the first index that has the version
(multiprocess's ``py310`` wheel on Python 3.11 fails in ``fork_exec``). A distribution is listed
when every tag in its WHEEL file is ``pyXY-none-any`` and no ``XY`` is the running version's:
pip then puts the right wheel in its place.
"""

from __future__ import annotations

import re
import sys
from email.parser import HeaderParser
from pathlib import Path

_VERSIONED = re.compile(r"^py(\d)(\d+)-none-any$")


def foreign_wheels(site_dirs: list[str], version: tuple[int, int] = sys.version_info[:2]) -> list[str]:
    """``name==version`` of each distribution in ``site_dirs`` built only for other Python versions."""
    found: list[str] = []
    for site in site_dirs:
        for wheel in sorted(Path(site).glob("*.dist-info/WHEEL")):
            tags = [t.strip() for t in HeaderParser().parsestr(wheel.read_text(errors="replace")).get_all("Tag") or []]
            versions = [_VERSIONED.match(t) for t in tags]
            if not tags or not all(versions):
                continue
            if any((int(m.group(1)), int(m.group(2))) == tuple(version) for m in versions if m):
                continue
            metadata = HeaderParser().parsestr((wheel.parent / "METADATA").read_text(errors="replace"))
            if metadata.get("Name") and metadata.get("Version"):
                found.append(f"{metadata['Name']}=={metadata['Version']}")
    return found


def main() -> int:
    import site
    import sysconfig

    dirs = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]))
    for line in foreign_wheels([d for d in dirs if Path(d).is_dir()]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
