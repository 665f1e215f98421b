"""What a request body must be before pydantic looks at it: nested no deeper than `MAX_JSON_DEPTH`, and
valid Unicode throughout (no lone surrogates, in values or keys, in known fields or ignored extras).

Its own module because it is a check of the parsed JSON as a whole, not of any one field: every whole
request body (`request_bodies.ClientRequest`, which the Responses API's request builds on too) runs it
before its first field is validated. Its errors name the place in the body with `client_error_path`,
which the Responses API's request uses for its own errors as well.
"""

from __future__ import annotations

from typing import Any

from frontend.api_types.errors import invalid_request

MAX_JSON_DEPTH = 64  # the deepest nesting of arrays and objects a request body may have


def client_error_path(path: tuple[str | int, ...]) -> str:
    """A location in the body for an error's message and `param`: dotted, and short (keys come from the
    client and may be long)."""
    text = ".".join(str(part) for part in path)
    return text if len(text) <= 200 else text[:197] + "..."


def encodable(text: str) -> bool:
    """Whether the string is valid Unicode: JSON may escape lone surrogates ("\\ud800"), which neither a
    tokenizer nor a UTF-8 response can carry."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(path: tuple[str | int, ...], in_key: bool = False) -> Exception:
    where = client_error_path(path)
    if in_key:
        what = f"a key of {where}" if where else "a key of the request body"
    else:
        what = where or "the request body"
    return invalid_request(f"{what}: invalid Unicode, a lone surrogate (\\ud800-\\udfff) that is not part of "
                           "a pair", where or None)


_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def check_client_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse (400, naming the field) a parsed request body nested deeper than `max_depth` arrays and
    objects, or holding a string (value or key, known field or ignored extra) with a lone surrogate.

    Iterative, never recursive, so that no body can raise RecursionError (a 500): this replaces the edge
    middleware's re-parse of the body. Keys are checked before any path through them is named, so an
    error's `param` never carries a lone surrogate into the (UTF-8) response. A list of numbers (a
    token-id prompt of a million ids) is passed over at C speed."""
    if isinstance(value, str):
        if not encodable(value):
            raise _lone_surrogate(())
        return
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not encodable(key):
                    raise _lone_surrogate(path, in_key=True)
            children: Any = item.items()
            types = set(map(type, item.values()))
        elif isinstance(item, list):
            children = enumerate(item)
            types = set(map(type, item))
        else:  # a Python value (a model) given directly: validated by its own type
            continue
        if len(path) >= max_depth:
            field = client_error_path(path[:1]) or None  # the field, not a path of `max_depth` parts
            raise invalid_request(f"the request body is nested deeper than {max_depth} levels of arrays and "
                                  f"objects{f' (in {field})' if field else ''}", field)
        if _SCALAR_TYPES.issuperset(types):  # numbers only (a token-id prompt): nothing to look into
            continue
        for key, child in children:
            if isinstance(child, str):
                if not encodable(child):
                    raise _lone_surrogate((*path, key))
            elif type(child) not in _SCALAR_TYPES:
                stack.append((child, (*path, key)))
