"""Names that become one path component: run names, checkpoint tags, files a manifest names.

[Note: names that become paths]
A run name becomes `<storage>/<name>/`, a checkpoint tag `<save dir>/<tag>/`, a manifest's file name
`<tag dir>/<file>`. Storage is reached through pyarrow.fs URIs, which percent-decode the path
(`..%2Fescaped` becomes `../escaped`: a run name that passed a plain `/` check made `fit` create
`<storage>/../escaped`) and read `?` and `#` as a query and a fragment (`?endpoint_override=...`
redirects an s3:// run to another server). So a name is checked *after* decoding and must stay
one plain component however it is read:
  - no path separator (`/`, and `\\` which is one on Windows), no `..` anywhere, not `.`;
  - no `%` (storage would decode it, so the name on disk would differ from the name given),
    no `?` or `#` (a URI would cut the name there);
  - no control or invisible characters (NUL, newlines, bidirectional overrides, ...) and no
    leading or trailing whitespace;
  - at most 253 bytes of UTF-8: a Kubernetes object name (a RayZeroJob's name is its run name)
    always fits, and a file system's 255-byte component limit is never hit.
Every entry point calls `check_name` (RunConfig.name, `rayzero run --name`, the control plane's run
lookup, `save_checkpoint`/`load_checkpoint` tags, `rayzero checkpoint import-deepspeed --tag`), and
so does everything that reads a name back from storage before joining it into a path (a manifest's
tag and file names, `latest`): a tampered manifest naming `../../x` makes a load or a delete touch
nothing outside its checkpoint directory.
"""
from __future__ import annotations

import unicodedata
from typing import Any
from urllib.parse import unquote

from rayzero.config.errors import RayZeroValueError

MAX_NAME_BYTES = 253
ALLOWED = ("one plain directory name: letters, digits and punctuation such as '.', '_', '-', without '/', "
           "'\\', '..', '%', '?', '#', control characters or surrounding spaces, at most "
           f"{MAX_NAME_BYTES} bytes (e.g. 'global_step100', 'gpt2-small-run3')")
"""What a valid name looks like, for error messages."""


def _decoded(value: str) -> str:
    """`value` percent-decoded until nothing changes (a doubly encoded `%252F` is a `/` too)."""
    for _ in range(8):
        decoded = unquote(value)
        if decoded == value:
            return value
        value = decoded
    return value


def name_problem(value: Any) -> str | None:
    """Why `value` cannot be used as a name ([Note: names that become paths]), or None if it can."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    decoded = _decoded(value)
    shown = f" (it decodes to {decoded!r}: storage URIs percent-decode names)" if decoded != value else ""
    for form in (decoded, value):
        if "/" in form or "\\" in form:
            return f"contains a path separator{shown}"
        if form in (".", "..") or ".." in form:
            return f"contains '..'{shown}"
        invisible = next((char for char in form if unicodedata.category(char).startswith("C")), None)
        if invisible is not None:
            return f"contains the control or invisible character {invisible!r}{shown}"
    if "%" in value:
        return "contains '%' (storage URIs would percent-decode it, so the directory would be named differently)"
    if "?" in value or "#" in value:
        return "contains '?' or '#' (a storage URI would read the rest as a query or a fragment)"
    if value != value.strip():
        return "has leading or trailing whitespace"
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"is {len(value.encode('utf-8', 'surrogatepass'))} bytes long, more than {MAX_NAME_BYTES}"
    return None


def check_name(value: Any, field: str) -> str:
    """`value` if it is a usable name, else a RayZeroValueError naming `field`, the value, why and
    what is allowed ([Note: names that become paths])."""
    problem = name_problem(value)
    if problem is not None:
        raise RayZeroValueError(f"{field} = {value!r} {problem}; use {ALLOWED}")
    return value
