"""Text cut short for a message, where its whitespace must stay as it is.

    log.warning("... response %r", clip(response, 200))   # "ab\n\ncd..." : newlines kept, shown by repr

Where whitespace may be collapsed (an exception's message on one line), use `textwrap.shorten`: it cuts at a word
and says so with its placeholder. It collapses every run of whitespace into one space, which would hide what a
response shown with repr looks like (blank lines, trailing spaces), hence this one helper.
"""

from __future__ import annotations


def clip(text: str, limit: int, placeholder: str = "...") -> str:
    """`text` as it is when it has at most `limit` characters, else its first `limit` and `placeholder`."""
    return text if len(text) <= limit else text[:limit] + placeholder
