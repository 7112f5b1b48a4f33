"""Property tests: whatever document a user hands us, the loaders give a Document or an InputError of
one line that starts with the file's path, and the checks then give Results, never an 'error' (a check
that raises is a defect of that check).

Reproducible: derandomized, no example database. About 30 s on two cores.
"""
from __future__ import annotations

import functools
import io
import json
import os
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from preflight import registry, runner
from preflight.inputs import documents
from preflight.inputs import configs as jobconfig
from preflight.inputs.deepspeed_keys import DS_REMOVED_KEYS, DS_TOP_KEYS, STRICT_BLOCKS
from preflight.report import render
from preflight.inputs.documents import InputError
from preflight.plan import build_plan
from preflight.result import Result, Status, verdict

SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
FAST = settings(max_examples=300, **SETTINGS)
SLOW = settings(max_examples=800, **SETTINGS)


def assert_input_error(exc: InputError, path: str) -> None:
    text = str(exc)
    assert len(text.splitlines()) == 1 and "\n" not in text, repr(text)
    assert text.startswith(path + ":"), (path, text)
    assert re.match(re.escape(path) + r"(:\d+)?: \S", text), text
    assert exc.path == path, (exc.path, path)
    assert exc.line is None or (isinstance(exc.line, int) and exc.line >= 1), exc.line


def loads_or_input_error(func, path, *args):
    """func(path, *args): its value, or None after checking the InputError; anything else fails the test."""
    try:
        return func(path, *args)
    except InputError as exc:
        assert_input_error(exc, path)
        return None


# --- values ---------------------------------------------------------------------------------------

WORDS = (
    ["auto", "none", "cpu", "nvme", "NO", "no", "yes", "all", "", " ", "0", "1", "-1", "5e8", "1e-5", "3.0", ".5",
     "0,1", "0,1,2,3", "0,0", "a,b", "static", "c10d", "pdsh", "LOCAL_MACHINE", "AMAZON_SAGEMAKER", "10.0.0.1",
     "user@host", "http://h:29500", "host:29500", "node-01", "::1", "[::1]", "fp16", "bf16", "fp8", "FP16",
     "DEEPSPEED", "MULTI_GPU", "deepspeed", "ds.json", "missing.json", "/", "é"]
    + list(jobconfig.DISTRIBUTED_TYPES) + list(jobconfig.MIXED_PRECISIONS) + list(jobconfig.OFFLOAD_DEVICES)
    + list(jobconfig.MULTINODE_LAUNCHERS) + list(jobconfig.RDZV_BACKENDS)
)
ints = st.one_of(st.integers(-3, 10), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 1023, 1024, 29500, 65535, 65536,
                                                      2 ** 31, 2 ** 63, 10 ** 30, -(10 ** 30)]),
                 st.integers())
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1.5, 5e8, -0.0]))
# characters that break a report: a lone surrogate (JSON's "\ud800") cannot be written as UTF-8; line breaks
# split a one-line message; escape sequences repaint the terminal
ODD = ["\ud800", "zero\udfffstage", "line\nbreak", "cr\rlf", "\u2028", "\x85", "\x1b[31mred", "tab\tbed", "\x00"]
strings = st.one_of(st.sampled_from(WORDS), st.text(max_size=12), st.sampled_from(ODD),
                    st.from_regex(r"[+-]?\d{1,4}(\.\d{0,3})?([eE][+-]?\d{1,3})?", fullmatch=True))
# what else YAML can hold (a JSON dump writes their repr())
yaml_only = st.one_of(st.dates(), st.datetimes(), st.binary(max_size=4), st.frozensets(strings, max_size=2).map(set))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, strings, yaml_only)


# Every strategy is built once (cached, or a constant below) and only drawn from in the composites: building
# one costs more than drawing from it (most of the run time when they were built at every draw).
@functools.lru_cache(maxsize=None)
def anything(max_leaves=8):
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.one_of(strings, st.sampled_from(KNOWN_KEYS)), inner, max_size=4),
                        max_leaves=max_leaves)


numeric_strings = st.one_of(st.sampled_from(["5e8", "1e-5", "16", " 8 ", "-1", ".5", "1.0E+3", "٣"]),
                            st.from_regex(r"[+-]?\d{1,4}(\.\d{0,3})?([eE][+-]?\d{1,3})?", fullmatch=True))


@functools.lru_cache(maxsize=None)
def of_types(types: tuple, wild: bool = False):
    """Values of the types a key accepts, so that the loaders let them through to the checks (numbers
    also as the strings that the CFG checks explain); with `wild`, sometimes any value at all."""
    pick = {int: st.one_of(ints, numeric_strings), float: st.one_of(floats, ints, numeric_strings),
            bool: st.booleans(), str: strings, type(None): st.none(),
            dict: st.dictionaries(strings, scalars, max_size=3), list: st.lists(scalars, max_size=3),
            jobconfig.AUTO: st.just("auto"), object: anything(4)}
    typed = st.one_of(*[pick[t] for t in types])
    return st.one_of(typed, typed, typed, anything(4)) if wild else typed


# --- documents built from the keys accelerate and DeepSpeed know -------------------------------------

DS_TOP = sorted(DS_TOP_KEYS | DS_REMOVED_KEYS)
STRICT = {k: sorted(v) for k, v in STRICT_BLOCKS.items()}

KNOWN_KEYS = sorted(set(jobconfig.ACCELERATE_KEYS) | set(jobconfig.ACCELERATE_DS_KEYS)
                    | {k for path in jobconfig.DS_NUMERIC for k in path} | set(DS_TOP))


@functools.lru_cache(maxsize=None)
def some_of(keys: tuple, wild: bool):
    """A mapping of some of these (key, types) pairs, each with a value of its types."""
    return st.fixed_dictionaries({}, optional={k: of_types(t, wild) for k, t in keys})


SAGEMAKER_FIELDS, ACCELERATE_FIELDS = (tuple(keys.items()) for keys in (jobconfig.SAGEMAKER_KEYS, jobconfig.ACCELERATE_KEYS))
ACCELERATE_DS_FIELDS = tuple(jobconfig.ACCELERATE_DS_KEYS.items())
UNKNOWN_SCALARS = st.dictionaries(strings, scalars, max_size=2)
UNKNOWN_OR_REMOVED = st.dictionaries(st.one_of(strings, st.sampled_from(sorted(jobconfig.ACCELERATE_REMOVED_KEYS))),
                                     anything(3), max_size=3)


@st.composite
def accelerate_docs(draw):
    # integers shrink to 0: `== N` makes a failing example shrink to the plain document, without extras
    wild = draw(st.integers(0, 9)) == 9  # mostly documents that load, so that the checks run on them
    sagemaker = draw(st.integers(0, 4)) == 4
    doc = draw(some_of(SAGEMAKER_FIELDS if sagemaker else ACCELERATE_FIELDS, wild))
    if sagemaker:
        doc["compute_environment"] = "AMAZON_SAGEMAKER"
    if draw(st.booleans()):
        section = draw(some_of(ACCELERATE_DS_FIELDS, wild))
        if draw(st.integers(0, 3)) == 3:  # DeepSpeed-JSON keys pasted inline
            section.update(draw(ds_docs()))
        if draw(st.integers(0, 3)) == 3:  # keys accelerate does not know
            section.update(draw(UNKNOWN_SCALARS))
        doc["deepspeed_config"] = draw(anything(3)) if wild and draw(st.booleans()) else section
    if draw(st.integers(0, 3)) == 3:  # unknown and removed keys
        doc.update(draw(UNKNOWN_OR_REMOVED))
    return doc


# the blocks DeepSpeed refuses unknown keys in: known keys, and misspelt or odd ones
STRICT_ENTRIES = {path: st.dictionaries(st.one_of(st.sampled_from(keys), st.sampled_from(keys), strings), scalars,
                                        max_size=4) for path, keys in STRICT.items()}
ENABLED = st.one_of(st.booleans(), st.just("auto"), scalars)
OFFLOAD_DEVICE = st.one_of(st.sampled_from(["none", "cpu", "nvme", "auto", "gpu", "CPU"]), scalars)
NVME_PATH = st.one_of(st.just("/local_nvme"), scalars)
RATIO = st.one_of(floats, ints, scalars)
ZERO_NOT_A_MAPPING = {False: st.one_of(st.booleans(), st.none(), st.none()),
                      True: st.one_of(st.booleans(), st.none(), anything(3))}  # by `wild`
OTHERS = [k for k in DS_TOP if k not in jobconfig.DS_SECTIONS and (k,) not in jobconfig.DS_NUMERIC]
OTHER_TOP = {wild: st.dictionaries(st.sampled_from(DS_TOP if wild else OTHERS), anything(3), max_size=3)
             for wild in (False, True)}
UNKNOWN_TOP = st.dictionaries(strings, anything(3), max_size=2)


@st.composite
def ds_docs(draw):
    wild = draw(st.integers(0, 9)) == 9
    doc = {}

    def block(*path):  # the mapping at path, made if missing (None where a value is in the way)
        node = doc
        for key in path:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                return None
        return node

    for path, types in jobconfig.DS_NUMERIC.items():
        if draw(st.integers(0, 3)) == 3 and block(*path[:-1]) is not None:
            block(*path[:-1])[path[-1]] = draw(of_types(types, wild))
    for path, entries in STRICT_ENTRIES.items():
        if draw(st.integers(0, 2)) == 2 and block(*path) is not None:
            block(*path).update(draw(entries))
    for name in ("fp16", "bf16", "bfloat16"):
        if draw(st.integers(0, 2)) == 2:
            block(name)["enabled"] = draw(ENABLED)
    for name in ("offload_param", "offload_optimizer"):
        if draw(st.integers(0, 2)) == 2 and block("zero_optimization", name) is not None:
            settings_ = block("zero_optimization", name)
            settings_["device"] = draw(OFFLOAD_DEVICE)
            if draw(st.booleans()):
                settings_["nvme_path"] = draw(NVME_PATH)
            if draw(st.booleans()):
                settings_["ratio"] = draw(RATIO)
    if draw(st.integers(0, 6)) == 6:
        doc["zero_optimization"] = draw(ZERO_NOT_A_MAPPING[wild])
    doc.update(draw(OTHER_TOP[wild]))
    if draw(st.integers(0, 4)) == 4:  # unknown keys
        doc.update(draw(UNKNOWN_TOP))
    return doc


HOSTS = st.one_of(st.sampled_from(["n1", "n2", "node-01", "10.0.0.1", "a", "a"]), st.from_regex(r"\S{1,8}", fullmatch=True))
GOOD_LINES = [
    st.builds(lambda h, n: f"{h} slots={n}", HOSTS, st.integers(1, 20) | st.sampled_from([10 ** 20])),
    st.builds(lambda h, n, sp: f"{h}{sp}slots{sp}={sp}{n} # c", HOSTS, st.integers(1, 8), st.sampled_from([" ", "\t", "  "])),
    st.sampled_from(["", "# comment", "   "]),
]
BAD_LINES = [st.sampled_from(["n1 slots=0", "n1", "n1 slots=", "n1 slots=x", "slots=4", "n1 slots=-1"]), st.text(max_size=20)]
HOSTFILE_LINES = {False: st.lists(st.one_of(*GOOD_LINES), max_size=6),  # by `wild`
                  True: st.lists(st.one_of(*(GOOD_LINES + BAD_LINES)), max_size=6)}


@st.composite
def hostfiles(draw):
    wild = draw(st.integers(0, 9)) == 9
    lines = draw(HOSTFILE_LINES[wild])
    ending = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    return ending.join(lines) + draw(st.sampled_from(["", ending]))


def dump(doc, kind: str, style: int) -> str:
    if kind == "json":
        return json.dumps(doc, indent=2 if style else None, allow_nan=True, default=repr)
    return yaml.safe_dump(doc, default_flow_style=[False, None, True][style % 3], allow_unicode=bool(style % 2),
                          sort_keys=False)


# --- arbitrary text and bytes ------------------------------------------------------------------------

TOKENS = [":", ": ", "- ", "-", "[", "]", "{", "}", ",", "&a ", "*a", "&b ", "*b", "<<: ", "!!str ", "!!int ",
          "!!binary ", "!!set ", "!!timestamp ", "!!python/object ", "!x ", "? ", "'", '"', "#", "---", "...", "\n",
          "  ", "\t", "|", ">", "%YAML 1.1\n", "~", "null", "true", "NO", "5e8", "1:30", "2001-13-45", "0x1F",
          ".inf", ".nan", "\\", "\\u", "\\x", "\ud800", "\x00", "\x07", "\ufeff", "\u2028", "\x85", "é", "\\ud800"] + \
         ["num_processes", "distributed_type", "deepspeed_config", "zero_optimization", "stage", "train_batch_size",
          '"a"', "1", "-1", "1.5", "auto"]
yamlish = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
jsonish = st.lists(st.sampled_from(['{', '}', '[', ']', ',', ':', '"a"', '"stage"', '"zero_optimization"', '1', '-0',
                                    '1e999', 'NaN', 'Infinity', 'null', 'true', '"\\ud800"', '"\\u0000"', '"\\"',
                                    ' ', '\n', '"', '\\', '"train_batch_size"', '"auto"']), max_size=40).map("".join)
texts = st.one_of(st.text(max_size=200), yamlish, jsonish)
PATH = "/configs/job.cfg"


@FAST
@given(texts)
def test_parse_yaml_any_text(text):
    doc = loads_or_input_error(documents.parse_yaml, PATH, text, "accelerate config")
    if doc is not None:
        assert isinstance(doc.data, dict) and doc.kind == "yaml"


@FAST
@given(texts)
def test_parse_json_any_text(text):
    doc = loads_or_input_error(documents.parse_json, PATH, text, "DeepSpeed config")
    if doc is not None:
        assert isinstance(doc.data, dict) and doc.kind == "json"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("inputs")


@FAST
@given(data=st.one_of(st.binary(max_size=300), texts.map(lambda t: t.encode("utf-8", "surrogatepass"))),
       name=st.sampled_from(["c.yaml", "c.json", "c.yml", "hostfile", "ds.JSON"]))
def test_load_any_bytes(workdir, data, name):
    path = os.path.join(workdir, name)
    with open(path, "wb") as handle:
        handle.write(data)
    for func in (lambda p: documents.load(p, "config"), jobconfig.load_accelerate_config,
                 jobconfig.load_deepspeed_config, jobconfig.load_hostfile):
        loads_or_input_error(func, path)


@FAST
@given(doc=anything(12), kind=st.sampled_from(["yaml", "json"]), style=st.integers(0, 2))
def test_any_structure(workdir, doc, kind, style):
    path = os.path.join(workdir, f"any.{kind}")
    text = dump(doc, kind, style)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as handle:
        handle.write(text)
    for func in (jobconfig.load_accelerate_config, jobconfig.load_deepspeed_config):
        loaded = loads_or_input_error(func, path)
        if loaded is not None:  # read as the YAML and JSON libraries read it (repr: nan != nan)
            plain = json.loads(text) if kind == "json" else yaml.safe_load(text)
            assert repr(loaded.data) == repr(plain)


# --- the whole way: loaders, plan, every config check -------------------------------------------------

CHECKS = [c for c in registry.load().checks if c.scope == "config"]


def note_event(text: str) -> None:
    """For --hypothesis-show-statistics: how many examples reach the checks."""
    if currently_in_test_context():
        from hypothesis import event

        event(text)


def run_checks(workdir, accel, ds, hosts, kinds, world, deep=False):
    paths = {}
    for name, doc, kind, style in (("accelerate", accel, kinds[0], kinds[2]), ("ds", ds, kinds[1], kinds[2])):
        if doc is None:
            continue
        paths[name] = os.path.join(workdir, f"{name}.{kind}")
        with open(paths[name], "w", encoding="utf-8", errors="surrogatepass") as handle:
            handle.write(dump(doc, kind, style))
    if hosts is not None:
        paths["hostfile"] = os.path.join(workdir, "hostfile")
        with open(paths["hostfile"], "w", encoding="utf-8", newline="") as handle:
            handle.write(hosts)
    try:
        plan = build_plan(config=paths.get("accelerate"), deepspeed=paths.get("ds"), hostfile=paths.get("hostfile"),
                          world_size=world, deep=deep)
    except InputError as exc:
        assert exc.path in paths.values(), exc.path
        assert_input_error(exc, exc.path)
        note_event(f"input error in {os.path.basename(exc.path)}")
        return None
    note_event("checks ran")
    results = runner.run(CHECKS, runner.CheckContext(plan))
    assert results and all(isinstance(r, Result) for r in results)
    errors = [f"{r.id}: {r.message}" for r in results if r.status is Status.ERROR]
    assert not errors, "a check raised (a defect in the check):\n" + "\n".join(errors)
    for r in results:
        assert isinstance(r.message, str) and r.message, r
        assert len(r.message.splitlines()) == 1, f"{r.id}: the message is not one line: {r.message!r}"
    # The reports over these results: one JSON document; a terminal report that a UTF-8 terminal can take.
    outcome = verdict(results)
    report = json.loads(render.to_json(results, outcome, [], 0.5))
    assert report["verdict"] == outcome and len(report["results"]) == len(results)
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # as strict as a real UTF-8 stdout
    render.terminal(results, outcome, 0.5, stream=stream)  # e.g. a lone surrogate, from JSON's "\ud800"
    stream.flush()
    return results


inputs = dict(
    accel=st.one_of(st.none(), accelerate_docs()),
    ds=st.one_of(st.none(), ds_docs()),
    hosts=st.one_of(st.none(), hostfiles()),
    kinds=st.tuples(st.sampled_from(["yaml", "yaml", "json"]), st.sampled_from(["json", "json", "yaml"]), st.integers(0, 2)),
    world=st.one_of(st.none(), st.integers(1, 64), st.just(10 ** 6)),
)


@SLOW
@given(**inputs)
def test_checks_never_raise(workdir, accel, ds, hosts, kinds, world):
    """Loaders, plan and every config check; then the reports."""
    run_checks(workdir, accel, ds, hosts, kinds, world)


@settings(max_examples=40, **SETTINGS)
@given(**inputs)
def test_library_validators_never_raise(workdir, accel, ds, hosts, kinds, world):
    """--deep: accelerate's and DeepSpeed's own validators (skipped where they are not installed)."""
    run_checks(workdir, accel, ds, hosts, kinds, world, deep=True)


# --- a few shapes the strategies above rarely reach --------------------------------------------------

@FAST
@given(depth=st.integers(1, 400), kind=st.sampled_from(["yaml", "json"]), mapping=st.booleans())
def test_nesting_depth(depth, kind, mapping):
    if kind == "json":
        opening, closing = ('{"a": ', "}") if mapping else ("[", "]")
        text = '{"x": ' + opening * depth + "1" + closing * depth + "}"
    else:
        opening, closing = ("{a: ", "}") if mapping else ("[", "]")
        text = "x: " + opening * depth + "1" + closing * depth
    parse = documents.parse_json if kind == "json" else documents.parse_yaml
    doc = loads_or_input_error(parse, PATH, text, "config")
    assert (doc is None) == (depth > documents.MAX_DEPTH), (depth, doc is None)


@FAST
@given(width=st.integers(1, 12), levels=st.integers(1, 8))
def test_alias_expansion(width, levels):
    """Lists of aliases of lists: refused exactly when the values, every alias expanded, pass the limit."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    sizes = [1 + width]
    for _ in range(1, levels):
        sizes.append(1 + width * sizes[-1])
    doc = loads_or_input_error(documents.parse_yaml, PATH, "\n".join(lines), "config")
    assert (doc is None) == (1 + sum(sizes) > documents.MAX_VALUES), (width, levels, sizes)


@FAST
@given(key=st.one_of(st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False),
                     st.sampled_from(["? [1, 2]", "? {a: 1}", "2024-01-01", "!!binary aGk=", "~", ""])),
       before=st.integers(0, 5), nested=st.booleans())
def test_non_string_keys(key, before, nested):
    """A key that YAML does not read as a string is refused, at its line."""
    written = key if isinstance(key, str) else yaml.safe_dump(key).splitlines()[0]
    if written.startswith("?"):
        entry = f"{written}\n: 1\n"
    else:
        entry = f"{written}: 1\n"
    text = "".join(f"k{i}: {i}\n" for i in range(before))
    text += "x:\n" + "".join("  " + part + "\n" for part in entry.splitlines()) if nested else entry
    with pytest.raises(InputError) as caught:
        documents.parse_yaml(PATH, text, "config")
    assert_input_error(caught.value, PATH)
    assert caught.value.line == before + 1 + nested, (text, str(caught.value))


def test_a_check_that_raises_is_reported(workdir, monkeypatch):
    """The harness itself: a check that raises must fail the property above."""
    from preflight.registry import check

    @check("TST001", "always-raises", "config")
    def broken(ctx):
        """Raises.

        To prove the harness.

        None.
        """
        raise KeyError("boom")

    monkeypatch.setitem(globals(), "CHECKS", [broken.__preflight_check__])
    with pytest.raises(AssertionError, match="TST001"):
        run_checks(workdir, {"distributed_type": "NO"}, None, None, ("yaml", "json", 0), None)
