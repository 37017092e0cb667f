"""StructuredOutputsParams: vLLM's offline spelling of a constraint on the output.

Plain data only, because SamplingParams are pickled into the engine process; the grammar is
compiled there. validate() parses the grammar without a tokenizer (milliseconds), so a bad
schema or regex fails where the request is built (HTTP 400, ValueError offline), not later
in the engine.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "regex", "choice", "grammar", "json_object"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar", "json_object")
# OpenAI's json_object: any JSON object (not any JSON value).
ANY_OBJECT_SCHEMA = '{"type": "object"}'


def _fail(name: str, message: str) -> None:
    raise ValueError(f"SamplingParams.structured_outputs.{name} {message}")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set."""
    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF as xgrammar (and vLLM's xgrammar backend) read it
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> Kind:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Raise ValueError naming the field: not exactly one set, a wrong type, or a grammar
        that does not parse."""
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            _fail(chosen[1] if chosen else "json",
                  f"exactly one of {', '.join(KINDS)} must be set, got {chosen or 'none'}")
        kind = chosen[0]
        self._check_type(kind)
        try:
            _check_parses(kind, self.spec())
        except RuntimeError as err:  # xgrammar's parse errors: keep the message, drop its log prefix
            _fail(kind, f"is not a valid {kind}: {str(err).split(': ', 1)[-1].strip()}")

    def _check_type(self, kind: Kind) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as err:
                    _fail(kind, f"must be a JSON schema (an object), got invalid JSON: {err}")
            if not isinstance(value, (dict, bool)):
                _fail(kind, f"must be a JSON schema (an object), got {type(value).__name__}")
            if isinstance(value, dict):
                problem = schema_problem(value)
                if problem:
                    _fail(kind, problem)
        elif kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                _fail(kind, f"must be a non-empty list of non-empty strings, got {value!r}")
        elif kind == "json_object":
            if value is not True:
                _fail(kind, f"must be true or unset, got {value!r}")
        elif not (isinstance(value, str) and value):
            _fail(kind, f"must be a non-empty string, got {value!r}")

    def spec(self) -> str:
        """The canonical text of the constraint: the grammar cache's key with kind()."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return json.dumps(schema, ensure_ascii=False)  # key order is the output's order: kept
        if kind == "json_object":
            return ANY_OBJECT_SCHEMA
        if kind == "choice":
            return choice_ebnf(self.choice)
        return getattr(self, kind)


# Deeper documents cost xgrammar's parser seconds (it grows with the cube of the depth) and
# cannot be pickled to the engine process; real schemas nest a few levels.
MAX_SCHEMA_DEPTH = 64
# Keywords xgrammar 0.2.8 does not enforce: a schema holding one would be answered with output
# that does not validate, against "the grammar is the schema". Refused, as vLLM's xgrammar
# backend refuses them.
# (patternProperties it does enforce; unevaluated* hold anyway: strict, it writes no property
# or item the schema does not name)
UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
              "dependentSchemas", "dependentRequired", "propertyNames")
# Where a schema holds subschemas: one, a list of them, a mapping of them
SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
             "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
# What may sit beside $ref: xgrammar follows the reference and drops any other constraint
REF_COMPANIONS = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title",
                  "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why the grammar could not be the schema (too deep, or a keyword xgrammar would drop),
    or None. Iterative: a document nested past the recursion limit is refused, not crashed on."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    schemas = [schema]
    while schemas:
        node = schemas.pop()
        if not isinstance(node, dict):
            continue
        problem = _node_problem(node)
        if problem:
            return problem
        schemas += [node[k] for k in SUBSCHEMA if k in node]
        schemas += [s for k in SUBSCHEMA_LISTS if isinstance(node.get(k), list) for s in node[k]]
        schemas += [s for k in SUBSCHEMA_MAPS if isinstance(node.get(k), dict)
                    for s in node[k].values()]
    return None


def _node_problem(node: dict[str, Any]) -> str | None:
    unenforced = [k for k in UNENFORCED if k in node]
    if node.get("uniqueItems"):
        unenforced.append("uniqueItems")
    if unenforced:
        return f"uses {unenforced[0]!r}, which the grammar cannot enforce: remove it"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "combines schemas with 'allOf', which the grammar cannot enforce: merge them"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return ("bounds the length of a string that has a 'pattern' or 'format', which the "
                "grammar cannot enforce together: put the bounds in the pattern")
    if "$ref" in node and set(node) - REF_COMPANIONS:
        extra = sorted(set(node) - REF_COMPANIONS)[0]
        return (f"puts {extra!r} beside '$ref', which the grammar would drop: move it into the "
                "referenced schema")
    return None


def choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes; non-ASCII stays literal.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=256)
def _check_parses(kind: Kind, spec: str) -> None:
    # A request is validated where it is built and again in the engine, and a server sees
    # the same few schemas: parsing each time cost ~0.1 ms per step at 32 requests.
    grammar = parse_grammar(kind, spec)
    if kind in ("regex", "grammar") and admits_nothing(grammar):
        raise RuntimeError("it matches no text at all, so no output could follow it")


def admits_nothing(grammar: Any) -> bool:
    """Whether no text (not even the empty one) is in the grammar's language: compiled over a
    vocabulary of the 256 bytes, which spells any text, its first step allows no byte and it
    cannot end (~0.1-2 ms). Such a request would otherwise sample outside its grammar."""
    import xgrammar as xgr
    compiled = _byte_compiler().compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    mask = xgr.allocate_token_bitmask(1, 256)
    matcher.fill_next_token_bitmask(mask)
    return not bool(mask.any()) and not matcher.is_terminated()


@functools.cache
def _byte_compiler() -> Any:
    import xgrammar as xgr
    return xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([b]) for b in range(256)]),
                               max_threads=1, cache_enabled=False)


def import_grammar_library() -> None:
    """Import xgrammar now, at a server's start: its first constrained request would otherwise
    import it on the engine's step loop (and on the replica's event loop), 0.1-0.3 s during
    which every other stream stalls. Offline, the caller's own SamplingParams import it."""
    import xgrammar  # noqa: F401


def parse_grammar(kind: Kind, spec: str) -> Any:
    """The tokenizer-independent grammar (xgrammar.Grammar); RuntimeError when it does not parse."""
    import xgrammar as xgr  # only requests with a constraint pay for the import
    if kind in ("json", "json_object"):
        return _json_grammar(xgr, spec)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    return xgr.Grammar.from_ebnf(spec)


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this class,
# which admits raw control characters (a tab, \x00): not JSON (RFC 8259 wants them escaped),
# and json.loads refuses them. Its plain-string rule excludes them; so does the replacement.
_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_grammar(xgr: Any, spec: str) -> Any:
    grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))
