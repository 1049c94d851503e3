"""The generated reference pages: the server's HTTP API from its OpenAPI document, and braid's
Python API from the signatures and docstrings of the names `braid` exports. Both are made when
the docs are built, so they cannot drift from the code.

    python tools/docs/reference.py server > /tmp/server-api.md
    python tools/docs/reference.py python > /tmp/python-api.md
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

METHODS = ("get", "head", "post", "put", "patch", "delete")


def server_openapi() -> dict[str, Any]:
    """The OpenAPI document of the app `braid serve` runs, built as `serve` builds it on the
    embedded model: the real settings, tokenizer and `TokenizerManager`. The app is never
    started (its lifespan, which starts the runtime's processes, does not run): the document
    depends only on the routes and the protocol models."""
    from braid.runtime.assets import ModelAssets
    from braid.runtime.config import EngineConfig
    from braid.runtime.launch import spawn_runtime
    from braid.runtime.multimodal.frontend import MediaFrontend
    from braid.runtime.server.app import ServerState, create_app
    from braid.runtime.tokenizer.manager import TokenizerManager

    config = EngineConfig()
    assets = ModelAssets.load(config.model)
    tm = TokenizerManager(config, assets.path, assets.eos_token_ids, spawn=spawn_runtime)
    state = ServerState(
        tm=tm,
        tokenizer=assets.tokenizer,
        served_model_name="smollm2-135m",
        model_path=str(assets.path),
        defaults=assets.default_sampling_params(config.generation_config),
        media=MediaFrontend(config, assets.path, assets.config, assets.tokenizer),
    )
    return create_app(state).openapi()


def _cell(text: Any) -> str:
    """`text` fit for one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _type(s: dict[str, Any]) -> str:
    """A JSON schema as a short type (Markdown, schema names linked)."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in s:
            return " \\| ".join(dict.fromkeys(_type(x) for x in s[key]))
    if "allOf" in s and len(s["allOf"]) == 1:
        return _type(s["allOf"][0])
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    if "enum" in s:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    t = s.get("type")
    if t == "array":
        return f"list[{_type(s.get('items', {}))}]"
    if t == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"dict[str, {_type(s['additionalProperties'])}]"
    if isinstance(t, list):
        return " \\| ".join(t)
    return {"null": "null", None: "any"}.get(t, t)


def _schema_section(name: str, s: dict[str, Any]) -> list[str]:
    lines = [f"### {name} {{#{_anchor(name)}}}", ""]
    if s.get("description"):
        lines += [_escape(s["description"]), ""]
    props = s.get("properties")
    if not props:
        lines += [f"Type: {_type(s)}", ""]
        return lines
    required = set(s.get("required", ()))
    lines += [
        "| field | type | required | default | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for field, fs in props.items():
        default = f"`{json.dumps(fs['default'])}`" if "default" in fs else ""
        desc = _cell(_escape(fs.get("description", "")))
        req = "yes" if field in required else ""
        lines.append(f"| `{field}` | {_type(fs)} | {req} | {_cell(default)} | {desc} |")
    return [*lines, ""]


def render_server_api(doc: dict[str, Any]) -> str:
    """The Markdown reference page for OpenAPI document `doc`."""
    ops = [
        (path, method, op)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in METHODS
    ]
    out = [
        "# Server API reference",
        "",
        f"Generated from the OpenAPI document of `braid serve` ({doc['info']['title']} "
        f"{doc['info']['version']}, OpenAPI {doc['openapi']}) when these docs were built; a "
        "running server serves the same document at `/openapi.json`. The guide to the "
        "endpoints is [The server](../server.md).",
        "",
        "Every error, from every route, is an [ErrorResponse](#schema-errorresponse) "
        '(`{"error": {"message", "type", "param", "code"}}`).',
        "",
        "## Endpoints",
        "",
        "| method | path | body | summary |",
        "| --- | --- | --- | --- |",
    ]
    common = _common_responses([op for _, _, op in ops])
    for path, method, op in ops:
        out.append(
            f"| {method.upper()} | [`{path}`](#{_op_anchor(method, path)}) | {_body(op)} | "
            f"{_cell(op.get('summary', ''))} |"
        )
    out.append("")
    for path, method, op in ops:
        out += [f"### {method.upper()} `{path}` {{#{_op_anchor(method, path)}}}", ""]
        if op.get("description"):
            out += [_escape(op["description"]), ""]
        if "requestBody" in op:
            out += [f"Body: {_body(op)}", ""]
        params = op.get("parameters", [])
        if params:
            out += ["| parameter | in | type | required |", "| --- | --- | --- | --- |"]
            for p in params:
                req = "yes" if p.get("required") else ""
                out.append(f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} | {req} |")
            out.append("")
        out += ["| status | meaning | body |", "| --- | --- | --- |"]
        for status, resp in op.get("responses", {}).items():
            if status in common:
                continue
            content = resp.get("content", {})
            bodies = [
                f"{ctype}: {_type(c['schema'])}" if c.get("schema") else ctype
                for ctype, c in content.items()
            ]
            out.append(f"| {status} | {_cell(resp.get('description', ''))} | {', '.join(bodies)} |")
        out.append("")
    if common:
        out += ["Every route may also answer with these (listed once here):", ""]
        out += ["| status | meaning |", "| --- | --- |"]
        out += [f"| {status} | {_cell(desc)} |" for status, desc in common.items()]
        out.append("")
    out += ["## Schemas", ""]
    for name, s in sorted(doc.get("components", {}).get("schemas", {}).items()):
        out += _schema_section(name, s)
    return "\n".join(out)


def _common_responses(ops: list[dict[str, Any]]) -> dict[str, str]:
    """The responses (status -> description) every operation in `ops` lists alike."""
    first = ops[0].get("responses", {}) if ops else {}
    return {
        status: resp.get("description", "")
        for status, resp in first.items()
        if not status.startswith("2")
        and all(op.get("responses", {}).get(status) == resp for op in ops)
    }


def _op_anchor(method: str, path: str) -> str:
    return "op-" + method + "-" + (re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "root")


def _body(op: dict[str, Any]) -> str:
    content = op.get("requestBody", {}).get("content", {})
    return ", ".join(_type(c["schema"]) for c in content.values() if c.get("schema"))


_SPECIAL = re.compile(r"([<>&*_\[\]])")


def _escape(text: str) -> str:
    """Prose from a docstring or schema as Markdown: code spans kept, everything else literal."""
    parts = str(text).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = _SPECIAL.sub(r"\\\1", parts[i]).replace("\\<", "&lt;").replace("\\>", "&gt;")
        parts[i] = parts[i].replace("\\&", "&amp;")
    return "`".join(parts)


class _Annotation:
    """A string annotation (`from __future__ import annotations`) shown without its quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Any) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None

    def bare(a: Any) -> Any:
        return _Annotation(a) if isinstance(a, str) else a

    params = [p.replace(annotation=bare(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=bare(sig.return_annotation)))


def _wrapped(name: str, sig: str) -> str:
    """`name(sig)`, one parameter a line when it is long."""
    if len(name) + len(sig) <= 96:
        return name + sig
    close = sig.rindex(")")
    params, depth, start = [], 0, 1
    for i, ch in enumerate(sig[:close]):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 1:
            params.append(sig[start:i].strip())
            start = i + 1
    params.append(sig[start:close].strip())
    return name + "(\n" + "".join(f"    {p},\n" for p in params) + ")" + sig[close + 1 :]


def _doc(obj: Any) -> list[str]:
    doc = inspect.getdoc(obj)
    if not doc or (inspect.isclass(obj) and doc.startswith(obj.__name__ + "(")):
        return []  # the dataclass's generated docstring repeats the signature
    return [_escape(doc), ""]


def render_python_api() -> str:
    """The Markdown reference page for every name `braid` exports."""
    import braid

    out = [
        "# Python API reference",
        "",
        "Generated from the signatures and docstrings of the names `braid` exports "
        "(`braid.__all__`) when these docs were built. How the language fits together is in "
        "[The language](../language.md); the offline API's settings are "
        "`SamplingParams`' fields below.",
        "",
    ]
    seen: dict[int, str] = {}
    for name in braid.__all__:
        obj = getattr(braid, name)
        if id(obj) in seen:
            out += [
                f"## `braid.{name}`",
                "",
                f"The same object as [`braid.{seen[id(obj)]}`](#{_py_anchor(seen[id(obj)])}).",
                "",
            ]
            continue
        seen[id(obj)] = name
        kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "object"
        target = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
        out += [
            f"## `braid.{name}` {{#{_py_anchor(name)}}}",
            "",
            f"*{kind}*, defined in `{target.__module__}`",
            "",
        ]
        sig = _signature(obj) if callable(obj) else None
        if sig is not None:
            out += ["```python", _wrapped(name, sig), "```", ""]
        out += _doc(obj if callable(obj) and not inspect.isclass(type(obj)) else obj)
        if inspect.isclass(obj):
            out += _methods(obj)
    return "\n".join(out)


def _py_anchor(name: str) -> str:
    return "braid-" + name.lower()


def _methods(cls: type) -> list[str]:
    out = []
    for mname, member in vars(cls).items():
        if mname.startswith("_"):
            continue
        func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if isinstance(member, property):
            out += [f"- `{mname}` (property)" + _first_line(member)]
        elif inspect.isfunction(func):
            out += [f"- `{mname}{_signature(func) or '(...)'}`" + _first_line(func)]
    return ["Members:", "", *out, ""] if out else []


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    return ": " + _escape(doc.split("\n\n")[0].replace("\n", " ")) if doc else ""


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's braid
    which = sys.argv[1] if len(sys.argv) == 2 else ""
    if which == "server":
        print(render_server_api(server_openapi()))
    elif which == "python":
        print(render_python_api())
    else:
        sys.exit(f"usage: {sys.argv[0]} server|python")


if __name__ == "__main__":
    main()
