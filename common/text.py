"""Text cut short for a message, where its whitespace must stay as it is.

    log.warning("... response %r", clip(response, 200))   # "ab\n\ncd..." : newlines kept, shown by repr

Where whitespace may be collapsed (an exception's message on one line), `one_line`: `textwrap.shorten`, which cuts
at a word and says so with its placeholder, except that a first word longer than the width (a long path or URL) is
cut too, where `textwrap.shorten` would leave the placeholder alone. Collapsing every run of whitespace into one space
would hide what a response shown with repr looks like (blank lines, trailing spaces), hence `clip` for those.
"""

from __future__ import annotations

import textwrap


def clip(text: str, limit: int, placeholder: str = "...") -> str:
    """`text` as it is when it has at most `limit` characters, else its first `limit` and `placeholder`."""
    return text if len(text) <= limit else text[:limit] + placeholder


def one_line(text: str, width: int, placeholder: str = " ...") -> str:
    """`text` on one line (whitespace collapsed) in at most `width` characters, cut at a word and marked with
    `placeholder`; a first word longer than that is cut inside it (never the placeholder alone)."""
    short = textwrap.shorten(text, width, placeholder=placeholder)
    if short != placeholder.strip() and short != placeholder:
        return short
    flat = " ".join(text.split())
    return flat[: max(0, width - len(placeholder))] + placeholder
