"""DeepSpeed's ``universal_checkpoint_info``: its keys, and the check of what a client, a module
or a stored step gives as one.

The info says how each parameter of a model-parallel model is split (``parallel.tensor_splits``
reads it); the keys are DeepSpeed's (``deepspeed.checkpoint.constants``). It comes from the
client or its module, so it is checked before anything is written (BadInputError), and again
when read back from a step (CorruptError): nothing a store holds is trusted.

Its patterns are regular expressions a store's writer chose, matched against every parameter
name: each is at most ``MAX_PATTERN_CHARS`` long, and each match is bounded in time
(``CKPTSTORE_PATTERN_SECONDS``) by the ``regex`` package, which reads the same syntax as
``re`` (what ``ds_to_universal`` matches with) and, unlike it, stops a match that runs too long.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import regex

from .. import knobs
from ..errors import BadInputError, CorruptError, clip

# DeepSpeed's universal-checkpoint vocabulary (deepspeed.checkpoint.constants).
UNIVERSAL_INFO = "universal_checkpoint_info"
AUTOTP_META = "ds_autotp_universal_checkpoint_meta"
REPLICATED = "tp_replicated_parameter_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
AVERAGED = "parameter_to_average_patterns"
TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
UNSUPPORTED = "autotp_unsupported_parameter_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
ORIGINAL_VOCAB = "original_vocab_size"
_PIPELINE_REPLICATED = "pipeline_replicated_parameter_patterns"
_PADDED_VOCAB = "padded_vocab_size"
_VERSION = "universal_checkpoint_version"
# The keys whose value is a list of patterns (AutoTP's unsupported ones: pattern -> reason).
_PATTERN_KEYS = (
    REPLICATED, ROW_PARALLEL, AVERAGED, TWO_SUB_PARAMS, VOCABULARY, _PIPELINE_REPLICATED, UNSUPPORTED,
)  # fmt: skip
_SUB_PARAM_KEYS = {"patterns", "shape", "partition_dim"}  # DeepSpeed's SubparamShape
AFFINE_MAP = "affine_map"  # AutoTP's: {"params": {pattern: ParamAffineMap.to_dict()}}
# Far past any parameter name DeepSpeed's patterns spell out, far below a pattern built to be slow.
MAX_PATTERN_CHARS = 1024
MAX_PATTERNS = 100_000


def check_universal_info(info: object, error: type[Exception] = BadInputError) -> None:
    """``error`` (BadInputError: the client's or module's) naming the key and the entry of a
    ``universal_checkpoint_info`` this ckptstore and ``ds_to_universal`` cannot read: anything
    but a dict, a pattern list that is none or holds a pattern that is no string or no valid
    regular expression, a ``parameter_with_sub_params`` entry that is not DeepSpeed's
    ``SubparamShape`` (``patterns``, ``shape`` of ints or tuples of ints, ``partition_dim`` an
    index of it), an ``original_vocab_size`` or ``padded_vocab_size`` that is no positive int,
    a version that is no number. None passes (there is none)."""
    problem = universal_info_problem(info)
    if problem is not None:
        raise error(f"{UNIVERSAL_INFO} {problem}")


def universal_info_problem(info: object) -> str | None:
    """What ``check_universal_info`` refuses in ``info``, or None."""
    if info is None:
        return None
    if not isinstance(info, dict):
        return f"is no dict ({info!r:.80})"
    for key in _PATTERN_KEYS:
        if key in info and (problem := _patterns_problem(info[key], allow_dict=key == UNSUPPORTED)):
            return f"{key} {problem}"
    affine = info.get(AFFINE_MAP, {})
    params = affine.get("params", {}) if isinstance(affine, dict) else None
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        return f"{AFFINE_MAP} is no dict whose params map patterns to dicts ({affine!r:.80})"
    if problem := _patterns_problem(list(params)):
        return f"{AFFINE_MAP} {problem}"
    entries = info.get(SUB_PARAMS, [])
    if not isinstance(entries, (list, tuple)):
        return f"{SUB_PARAMS} is no list of sub-parameter entries ({entries!r:.80})"
    for entry in entries:
        if (problem := _sub_param_problem(entry)) is not None:
            return f"{SUB_PARAMS} has an entry {problem} ({entry!r:.120})"
    for key in (ORIGINAL_VOCAB, _PADDED_VOCAB):
        if key in info and not (type(info[key]) is int and info[key] > 0):
            return f"{key} is no positive int ({info[key]!r:.80})"
    version = info.get(_VERSION, 0.0)
    if type(version) not in (int, float):
        return f"{_VERSION} is no number ({version!r:.80})"
    return None


def _patterns_problem(patterns: object, allow_dict: bool = False) -> str | None:
    if not isinstance(patterns, (list, tuple)) and not (allow_dict and isinstance(patterns, dict)):
        return f"is no list of patterns ({patterns!r:.80})"
    if len(patterns) > MAX_PATTERNS:
        return f"has {len(patterns)} patterns, more than the {MAX_PATTERNS} allowed"
    for pattern in patterns:
        if not isinstance(pattern, str):
            return f"has a pattern that is no string ({pattern!r:.80})"
        if len(pattern) > MAX_PATTERN_CHARS:
            return f"has a pattern longer than {MAX_PATTERN_CHARS} characters ({pattern!r:.80})"
        try:
            re.compile(pattern)  # DeepSpeed's ds_to_universal matches with re
            regex.compile(pattern)  # and this ckptstore with regex, in the same syntax
        except (re.error, regex.error) as error:
            return f"has a pattern that is no regular expression ({pattern!r:.80}: {error})"
    return None


def _sub_param_problem(entry: object) -> str | None:
    if not isinstance(entry, dict) or set(entry) != _SUB_PARAM_KEYS:
        return f"that is no dict of {', '.join(sorted(_SUB_PARAM_KEYS))}"
    if (problem := _patterns_problem(entry["patterns"])) is not None:
        return f"whose patterns {problem}"
    shape = entry["shape"]
    if not isinstance(shape, (list, tuple)) or not all(
        type(d) is int or (isinstance(d, (list, tuple)) and all(type(w) is int for w in d)) for d in shape
    ):
        return "whose shape is no list of ints or tuples of ints"
    dim = entry["partition_dim"]
    if type(dim) is not int or not 0 <= dim < len(shape):
        return "whose partition_dim is no index of its shape"
    return None


def matches(patterns: Iterable[str] | None, name: str, error: type[Exception] = CorruptError) -> bool:
    """Whether ``name`` matches any of ``patterns`` as ``ds_to_universal`` matches (``re.match``),
    each match bounded in time (``knobs.pattern_seconds``): ``error`` naming the pattern and the
    name where one runs past it (CorruptError: the patterns came from a stored step)."""
    return any(match(pattern, name, error) is not None for pattern in patterns or ())


def match(pattern: str, name: str, error: type[Exception] = CorruptError) -> regex.Match | None:
    """``re.match(pattern, name)`` bounded in time, as ``matches``."""
    seconds = knobs.pattern_seconds()
    try:
        return _compiled(pattern).match(name, timeout=seconds)
    except TimeoutError:
        raise error(
            f"{UNIVERSAL_INFO} pattern {clip(repr(pattern), 80)} takes more than {seconds:g} s to match "
            f"{clip(repr(name), 80)}: a pattern that backtracks without bound (CKPTSTORE_PATTERN_SECONDS)"
        ) from None


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> regex.Pattern:
    # regex.match's own cache costs more than the match of a short name
    return regex.compile(pattern)


def patterns_of(info: dict) -> list[str]:
    """Every pattern of a checked ``info`` (``check_universal_info``): each pattern list's, the
    sub-parameter entries' and the affine map's."""
    found = [pattern for key in _PATTERN_KEYS for pattern in info.get(key) or ()]
    found += [pattern for entry in info.get(SUB_PARAMS) or () for pattern in entry["patterns"]]
    return found + list((info.get(AFFINE_MAP) or {}).get("params") or {})


def check_patterns(info: dict | None, names: Iterable[str], what: str, error: type[Exception]) -> None:
    """Match every pattern of ``info`` against every one of ``names`` once, each match bounded
    as ``matches`` bounds it: ``error`` saying ``"<what>: ..."`` for a pattern that runs past
    the bound, before anything that matches them (a commit, a materialize) has begun. Patterns
    with nothing to repeat (AutoTP's affine map: one escaped name per parameter) are skipped:
    their matches take time linear in the pattern."""
    if not info:
        return
    patterns, names = [p for p in patterns_of(info) if may_backtrack(p)], list(names)
    for pattern in patterns:
        for name in names:
            try:
                match(pattern, name, error)
            except error as exc:
                raise error(f"{what}: {exc}") from None


def may_backtrack(pattern: str) -> bool:
    """Whether ``pattern`` repeats anything (``*``, ``+``, ``?`` or ``{`` outside a character
    class and unescaped): only such a pattern can take longer than its length to match."""
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char in "*+?{":
            return True
    return False
