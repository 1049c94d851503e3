"""Which JSON Schema keywords a grammar backend enforces, and the check that refuses a schema
using one it would ignore.

outlines-core and xgrammar turn a schema into a grammar keyword by keyword and skip those they
do not implement: outlines-core writes `{"type": "integer", "minimum": 1, "maximum": 9}` as an
unbounded integer, xgrammar drops `uniqueItems`, `not`, `if`/`then` and unknown formats. The
output then need not validate against the schema, with nothing to say so. `unenforced` walks
the schema the way a validator would (from the root, into every subschema, through local
`$ref`s) and names the first assertion the backend does not enforce, so the request is refused
(or given to a backend that enforces it) instead.

Keywords that are not assertions (title, description, default, examples, `x-` extensions,
unknown words) constrain nothing and pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Every keyword of JSON Schema drafts 4 to 2020-12 that constrains an instance.
ASSERTIONS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems",
        "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
        "minProperties", "required", "dependentRequired", "dependencies", "properties",
        "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
        "additionalItems", "contains", "unevaluatedItems", "unevaluatedProperties", "allOf",
        "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "$ref",
        "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip

# What outlines-core and xgrammar both enforce.
CORE = frozenset(
    {"type", "enum", "const", "required", "properties", "additionalProperties", "items",
     "prefixItems", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "pattern",
     "format", "minItems", "maxItems"}
)  # fmt: skip

# Where subschemas sit: a keyword whose value is one schema, a list of them, or a map of them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "dependentSchemas", "dependencies")


@dataclass(frozen=True)
class SchemaSupport:
    """What one backend enforces: `keywords` (the other assertions are refused), `formats`
    (the `format` values it writes a grammar for), whether a multi-branch `allOf` is merged,
    whether a `oneOf` is kept only when its branches provably exclude each other (a backend
    that writes it as `anyOf` would let an instance match two branches), whether
    `multipleOf` is enforced on integers only, whether keywords beside anyOf/oneOf/allOf/$ref
    in one schema apply together with it (as JSON Schema says), and whether a required key
    missing from `properties` is written. outlines-core and xgrammar do neither of the last
    two: each writes one side of such a schema alone, or an object without the key. Then
    whether an empty `type` list allows no value, as JSON Schema says (xgrammar allows any;
    outlines-core writes an empty value, `{"x": }`), whether a `$ref` that reaches itself is
    written in full (outlines-core unrolls it a few levels and writes the innermost without
    its recursive part, leaving a trailing comma or a required key out), and `apart`: pairs of
    keywords enforced alone but not in one schema (outlines-core drops `pattern` beside a
    length bound, and array bounds beside `prefixItems`)."""

    backend: str
    keywords: frozenset[str]
    formats: frozenset[str]
    merges_all_of: bool = False
    one_of_disjoint_only: bool = True
    multiple_of_integers_only: bool = False
    merges_siblings: bool = False
    writes_unlisted_required: bool = False
    empty_type_matches_nothing: bool = True
    writes_recursion: bool = True
    apart: frozenset[tuple[str, str]] = frozenset()


def unenforced(schema: Any, support: SchemaSupport) -> str | None:
    """Why `support.backend` cannot enforce `schema` (the keyword and where it stands), or
    None if it enforces every assertion in it."""
    if not support.writes_recursion:
        ref = _recursive_ref(schema)
        if ref is not None:
            by = f"{support.backend} backend"
            return f"$ref {ref!r} reaches itself: recursion is not enforced by the {by}"
    for path, node in _subschemas(schema):
        if not isinstance(node, dict):
            continue
        where, by = f"(at {path or '/'})", f"{support.backend} backend"
        why = _structure(node, support, where, by)
        if why is not None:
            return why
        for key, value in node.items():
            if key not in ASSERTIONS:
                continue
            if key not in support.keywords:
                return f"keyword {key!r} {where} is not enforced by the {by}"
            if key == "format" and (not isinstance(value, str) or value not in support.formats):
                return f"format {value!r} {where} is not enforced by the {by}"
            if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                return f"$ref {value!r} {where}: only references inside the schema are supported"
            if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
                return f"keyword {key!r} {where}: the draft-4 boolean form is not supported"
            if key == "type" and value == [] and not support.empty_type_matches_nothing:
                return f"an empty 'type' list {where} is not enforced by the {by}"
            if key == "multipleOf" and support.multiple_of_integers_only:
                if node.get("type") != "integer":
                    return f"multipleOf on a non-integer {where} is not enforced by the {by}"
            several = isinstance(value, list) and len(value) > 1
            if key == "allOf" and several and not support.merges_all_of:
                return f"allOf of several schemas {where} is not enforced by the {by}"
            if key == "oneOf" and support.one_of_disjoint_only and not _disjoint(value):
                return f"oneOf {where} has branches that may overlap: the {by} enforces anyOf"
    return None


_COMPOSERS = ("anyOf", "oneOf", "allOf", "$ref")


def _structure(node: dict, support: SchemaSupport, where: str, by: str) -> str | None:
    """What in how `node`'s keywords combine `support.backend` would not enforce."""
    if not support.merges_siblings:
        for key in _COMPOSERS:
            if key in node:
                others = sorted(k for k in node if k in ASSERTIONS and k != key)
                if others:
                    return f"{key} beside {others[0]!r} {where} is not enforced by the {by}"
    for first, second in sorted(support.apart):
        if first in node and second in node:
            return f"{first!r} beside {second!r} {where} is not enforced by the {by}"
    required = node.get("required")
    if not support.writes_unlisted_required and isinstance(required, list):
        listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [k for k in required if k not in listed]
        if missing:
            return (
                f"required key {missing[0]!r} {where} is not in properties: the {by} would "
                "not write it"
            )
    return None


def counted_open_object(schema: Any) -> str | None:
    """Why no backend enforces `schema`: `minProperties` of 2 or more on an object that
    admits keys beyond its `properties` (after `closed_objects`), with where it stands; or
    None. llguidance and xgrammar count such an object's members without knowing their keys,
    so they may write a key twice (`{"c": 2, "b": 10, "c": 2}`), which parses to fewer
    properties than they counted. That breaks only a lower bound past 1: `maxProperties`
    holds (fewer parse than were counted), and so does `minProperties` 1 (Pydantic's
    non-empty dict)."""
    for path, node in _subschemas(closed_objects(schema)):
        if not isinstance(node, dict):
            continue
        least = node.get("minProperties")
        types = node.get("type", "object")
        if not isinstance(least, int) or least < 2:
            continue
        if "object" not in (types if isinstance(types, list) else [types]):
            continue
        if node.get("additionalProperties") is not False or node.get("patternProperties"):
            return (
                f"'minProperties' {least} (at {path or '/'}) is not enforced on an object "
                "that admits keys beyond its properties (additionalProperties, "
                "patternProperties or propertyNames): a key may be written twice"
            )
    return None


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists
    `properties` and says nothing about other properties, as outlines-core and xgrammar's
    strict mode compile every schema: keys outside the schema's are not generated. Every
    instance of the result is an instance of `schema`. Left open: an object that requires a key
    outside its `properties` (closed, it would admit no instance), or whose `properties` lack a
    key that a schema applying to the same instance with it (its `anyOf` / `oneOf` branches,
    `$ref` targets, `if` / `then` / `else`, or theirs) requires (`_together`); and a schema
    with an `allOf` anywhere is left as it is (closing its branches one by one could exclude
    what their merge allows)."""
    if _mentions(schema, "allOf"):
        return schema
    kept_open = _together(schema)

    def close(node: Any) -> Any:
        if isinstance(node, list):
            return [close(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: close(v) for k, v in node.items()}
        opened = ("additionalProperties", "patternProperties", "unevaluatedProperties")
        listed = node.get("properties")
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if (
            isinstance(listed, dict)
            and id(node) not in kept_open
            and not any(k in node for k in opened)
            and all(k in listed for k in required)
        ):
            out["additionalProperties"] = False
        return out

    return close(schema)


def _together(root: Any) -> set[int]:
    """The ids of the object schemas in `root` that `closed_objects` must leave open: one
    whose `properties` lack a key that another schema applying to the same instance requires
    (reached from it, or it from that one, through `anyOf` / `oneOf` branches, `$ref`s or
    `if` / `then` / `else`). Closed, it would refuse that key, and the two together match no
    output; keys another schema merely lists are only narrowed away, which is allowed."""
    kept: set[int] = set()
    for _, node in _subschemas(root):
        if not isinstance(node, dict):
            continue
        for other in _same_instance(root, node):
            for a, b in ((node, other), (other, node)):
                listed = a.get("properties")
                required = b.get("required") if isinstance(b.get("required"), list) else []
                if isinstance(listed, dict) and any(k not in listed for k in required):
                    kept.add(id(a))
    return kept


# Where a subschema applies to the schema's own instance.
_SAME_INSTANCE_ONE = ("if", "then", "else")
_SAME_INSTANCE_LIST = ("anyOf", "oneOf")


def _same_instance(root: Any, node: dict) -> list[dict]:
    """The schemas other than `node` that apply to `node`'s instance with it: its branches,
    conditions and local `$ref` targets, and theirs, once each."""
    found: dict[int, dict] = {}
    stack = [node]
    while stack:
        here = stack.pop()
        subs = [here.get(k) for k in _SAME_INSTANCE_ONE]
        for key in _SAME_INSTANCE_LIST:
            if isinstance(here.get(key), list):
                subs.extend(here[key])
        ref = here.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            subs.append(_resolve(root, ref))
        for sub in subs:
            if isinstance(sub, dict) and id(sub) not in found and sub is not node:
                found[id(sub)] = sub
                stack.append(sub)
    return list(found.values())


def _mentions(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(_mentions(v, key) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, key) for v in node)
    return False


def _subschemas(root: Any) -> Iterator[tuple[str, Any]]:
    """Every schema a validator may apply, with its JSON pointer: the root, each subschema in
    an applicator keyword, and each local `$ref` target (once)."""
    seen: set[str] = set()
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in seen:
            seen.add(ref)
            target = _resolve(root, ref)
            if target is not None:
                stack.append((ref[1:] or "/", target))
        stack.extend(_children(path, node))


def _children(path: str, node: dict) -> Iterator[tuple[str, Any]]:
    """The subschemas directly in `node`'s applicator keywords, with their JSON pointers."""
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            yield f"{path}/{key}", node[key]
    for key in _LIST:
        if isinstance(node.get(key), list):
            yield from ((f"{path}/{key}/{i}", s) for i, s in enumerate(node[key]))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            yield from (
                (f"{path}/{key}/{name}", s)
                for name, s in node[key].items()
                if isinstance(s, (dict, bool))
            )


def _recursive_ref(root: Any) -> str | None:
    """A local `$ref` whose target, followed through its subschemas and their `$ref`s,
    reaches the same `$ref` again, or None."""
    refs: dict[str, set[str]] = {}  # each local $ref, and those directly inside its target
    for _, node in _subschemas(root):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
            refs[ref] = _refs_inside(_resolve(root, ref))
    for start in refs:
        seen: set[str] = set()
        stack = list(refs[start])
        while stack:
            ref = stack.pop()
            if ref == start:
                return start
            if ref not in seen:
                seen.add(ref)
                stack.extend(refs.get(ref, ()))
    return None


def _refs_inside(node: Any) -> set[str]:
    """The local `$ref`s in `node` and its subschemas, not following any."""
    found: set[str] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            found.add(ref)
        stack.extend(s for _, s in _children("", node))
    return found


def _resolve(root: Any, ref: str) -> Any:
    """The value a local JSON pointer (`#/$defs/pt`) names, or None."""
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_NUMERIC = {"integer", "number"}


def _disjoint(branches: Any) -> bool:
    """Whether no instance can match two of `branches`: each fixes its values (`const` or
    `enum`) and no value is shared, or each names its types and no type is shared (integer
    counts as a number)."""
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return False
    values = [_fixed_values(b) for b in branches]
    if all(v is not None for v in values):
        flat = [x for v in values for x in v]
        return len(flat) == len(set(flat))
    types = [_types(b) for b in branches]
    if any(t is None for t in types):
        return False
    for i, a in enumerate(types):
        for b in types[i + 1 :]:
            if a & b or (a & _NUMERIC and b & _NUMERIC):
                return False
    return True


def _fixed_values(branch: dict) -> list[str] | None:
    if "const" in branch:
        return [json.dumps(branch["const"], sort_keys=True)]
    if isinstance(branch.get("enum"), list):
        return [json.dumps(v, sort_keys=True) for v in branch["enum"]]
    return None


def _types(branch: dict) -> set[str] | None:
    t = branch.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None
