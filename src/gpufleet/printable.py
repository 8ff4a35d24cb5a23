"""Text from files others may write (lock files, process names) made safe to print on a terminal."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """``text`` with control and format characters (ANSI escapes, carriage returns, bidi overrides) escaped.

    A terminal would act on them: clear the screen, move the cursor, recolour or reorder what
    follows. Each one becomes its ``\\xNN`` / ``\\uNNNN`` escape, so that it is seen, not obeyed.
    """
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c == " " or unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(c)
        else:
            out.append(c.encode("unicode_escape").decode("ascii") if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "".join(out)
