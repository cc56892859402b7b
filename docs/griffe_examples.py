"""Griffe extension: render keras_dist's Keras-style `Example:` blocks as code.

keras_dist docstrings follow Keras: an `Example:` line, a blank line, then
doctest lines at the same indentation as the header. Griffe's Google parser
only recognises a section whose content is indented right below its header,
so without this the `>>>` lines render as nested block quotes. This rewrites
each such block into an indented `Examples:` section (rendered as `pycon`
code) when the docs are built; the docstrings themselves, and the doctests
that run them (tests/test_docstrings.py), are untouched.
"""

import re

import griffe

_HEADER = re.compile(r"^Examples?:\s*$")
_SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Keyword Args|Keyword Arguments|Note|Notes|"
    r"Raises|Returns|Yields|Receives|Warns|Warning|Warnings|See Also|"
    r"References|Examples?):\s*$")


def indent_examples(text):
    """Returns `text` with each unindented `Example:` block indented under it."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not _HEADER.match(line):
            out.append(line)
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or lines[j].startswith((" ", "\t")):
            out.append(line)  # already a well-formed (indented) section
            i += 1
            continue
        block = []
        while j < len(lines) and not _SECTION.match(lines[j]):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        out.append("Examples:")
        out.extend("    " + b if b.strip() else "" for b in block)
        out.append("")
        i = j
    return "\n".join(out)


class KerasStyleExamples(griffe.Extension):
    """Rewrites `Example:` blocks of every loaded docstring (see module doc)."""

    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = indent_examples(obj.docstring.value)
