"""Config files read as the library that opens them reads them: a DeepSpeed config as JSON whatever its name
(DeepSpeed with hjson, accelerate's and transformers' HfDeepSpeedConfig with json.load), accelerate's own config
as JSON only when its name ends in `.json` (accelerate/commands/config/config_args.py load_config_from_file), and
what one reader takes and another refuses judged by who reads the file (CFG008, CFG006)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import run_cli

ACCELERATE_NAMING = ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                     "  deepspeed_config_file: {name}\n")
JSON_WITH_EXPONENT = ('{\n  "train_micro_batch_size_per_gpu": 4,\n'
                      '  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}\n}\n')
YAML_DEEPSPEED = "train_micro_batch_size_per_gpu: 4\nzero_optimization:\n  stage: 2\n  reduce_bucket_size: 500000000\n"
TRAILING_COMMAS = '{\n  "train_micro_batch_size_per_gpu": 4,\n  "zero_optimization": {"stage": 2,},\n}\n'


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def lint(capsys, *args):
    cut = args.index("--") if "--" in args else len(args)  # --json is preflight's, not the launch command's
    code, doc, err = run_cli(capsys, "lint", *args[:cut], "--json", *args[cut:])
    assert code in (0, 1), f"exit {code}: {err}"
    return doc


def findings(doc, check_id):
    return [(r["status"], r["message"]) for r in doc["results"] if r["id"] == check_id]


def statuses(doc, check_id):
    return [r["status"] for r in doc["results"] if r["id"] == check_id]


def hjson_loads(text):
    if importlib.util.find_spec("hjson") is None:
        pytest.skip("hjson (DeepSpeed's reader) is not installed (the 'train' extra)")
    import hjson

    return hjson.loads(text)


def test_a_deepspeed_config_named_yaml_is_read_as_json_as_its_readers_read_it(capsys, tmp_path):
    # YAML 1.1 would read 5e8 as text; json.load and hjson read a number (deepspeed/runtime/config.py,
    # accelerate/utils/deepspeed.py HfDeepSpeedConfig open the file whatever its name)
    (tmp_path / "ds_zero2.yaml").write_text(JSON_WITH_EXPONENT)
    assert json.loads(JSON_WITH_EXPONENT)["zero_optimization"]["reduce_bucket_size"] == 5e8
    assert hjson_loads(JSON_WITH_EXPONENT)["zero_optimization"]["reduce_bucket_size"] == 5e8
    doc = lint(capsys, "--deepspeed", tmp_path / "ds_zero2.yaml")
    assert statuses(doc, "CFG003") == ["pass"], findings(doc, "CFG003")
    assert statuses(doc, "CFG008") == ["pass"], findings(doc, "CFG008")
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_NAMING.format(name="ds_zero2.yaml"))
    doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    assert doc["verdict"] == "pass", [r["message"] for r in doc["results"] if r["status"] != "pass"]


def test_a_deepspeed_config_written_in_yaml_is_refused_by_its_readers(capsys, tmp_path):
    with pytest.raises(json.JSONDecodeError):
        json.loads(YAML_DEEPSPEED)  # accelerate's DeepSpeedPlugin stops on it
    assert hjson_loads(YAML_DEEPSPEED)["zero_optimization"] == "stage: 2"  # DeepSpeed reads other settings
    (tmp_path / "ds.yaml").write_text(YAML_DEEPSPEED)
    doc = lint(capsys, "--deepspeed", tmp_path / "ds.yaml")  # a script may read the YAML itself: a warning
    [(status, message)] = findings(doc, "CFG008")
    assert status == "warn" and "ds.yaml: the DeepSpeed config is YAML, not JSON" in message, message
    assert "json.load stops on it (" in message and "ds.yaml:1: Expecting value" in message, message
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_NAMING.format(name="ds.yaml"))
    doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    assert statuses(doc, "CFG008") == ["fail"], findings(doc, "CFG008")


def test_trailing_commas_are_deepspeeds_alone(capsys, tmp_path):
    with pytest.raises(json.JSONDecodeError):
        json.loads(TRAILING_COMMAS)
    assert hjson_loads(TRAILING_COMMAS)["zero_optimization"] == {"stage": 2}
    (tmp_path / "ds.json").write_text(TRAILING_COMMAS)
    doc = lint(capsys, "--deepspeed", tmp_path / "ds.json")  # once bad input (exit 2): DeepSpeed reads it
    [(status, message)] = findings(doc, "CFG008")
    assert status == "warn" and "holds trailing commas: DeepSpeed reads it with hjson and takes them" in message
    assert "ds.json:3: Expecting property name enclosed in double quotes" in message, message
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_NAMING.format(name="ds.json"))
    doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    [fix] = [r["remediation"] for r in doc["results"] if r["id"] == "CFG008" and r["status"] == "fail"]
    assert fix == "delete the trailing commas"
    assert statuses(doc, "CFG040") == ["pass"]  # and the settings were read past them


def test_a_byte_order_mark_stops_json_load(capsys, tmp_path):
    text = '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}'
    (tmp_path / "ds.json").write_bytes(b"\xef\xbb\xbf" + text.encode())
    with pytest.raises(json.JSONDecodeError, match="BOM"):
        with open(tmp_path / "ds.json", encoding="utf-8") as handle:  # as HfDeepSpeedConfig opens it
            json.load(handle)
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_NAMING.format(name="ds.json"))
    doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    [(status, message)] = findings(doc, "CFG008")
    assert status == "fail" and "holds a byte order mark" in message, message
    (tmp_path / "ds.json").write_text(text)  # the same file without it
    assert statuses(lint(capsys, "--config", tmp_path / "accelerate.yaml"), "CFG008") == ["pass"]


def test_an_accelerate_json_config_with_a_byte_order_mark_is_bad_input(capsys, tmp_path):
    (tmp_path / "accelerate.json").write_bytes(b'\xef\xbb\xbf{"distributed_type": "NO", "num_processes": 1}')
    code, out, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.json")
    assert code == 2 and "accelerate.json:1: malformed JSON: it starts with a UTF-8 byte order mark" in err, err


def test_accelerate_reads_its_config_as_json_only_by_the_exact_suffix(capsys, tmp_path):
    # YAML reads this; json.load stops on the comment. accelerate tests `config_file.endswith(".json")`
    path = tmp_path / "accelerate.JSON"
    path.write_text('{"distributed_type": "NO", "num_processes": 1, "mixed_precision": "no"}  # one process\n')
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate.commands.config.config_args import load_config_from_file

        assert load_config_from_file(str(path)).num_processes == 1
    code, doc, err = run_cli(capsys, "lint", "--config", path, "--json")
    assert code == 0 and doc["verdict"] == "pass", err
    (tmp_path / "accelerate.json").write_text(path.read_text())  # named .json: accelerate's json.load refuses it
    code, out, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.json")
    assert code == 2 and "accelerate.json:1: malformed JSON" in err, err


def test_repeated_keys_in_the_deepspeed_json_fail_only_where_deepspeed_opens_the_file(capsys, tmp_path):
    text = ('{\n  "train_micro_batch_size_per_gpu": 4,\n  "train_micro_batch_size_per_gpu": 8,\n'
            '  "zero_optimization": {"stage": 2}\n}\n')
    assert json.loads(text)["train_micro_batch_size_per_gpu"] == 8  # json.load keeps the last
    (tmp_path / "ds.json").write_text(text)
    doc = lint(capsys, "--deepspeed", tmp_path / "ds.json")  # who opens it is not known: the HF Trainer keeps the last
    assert statuses(doc, "CFG006") == ["warn"], findings(doc, "CFG006")
    doc = lint(capsys, "--deepspeed", tmp_path / "ds.json", "--", "deepspeed", "train.py")  # DeepSpeed opens it
    assert statuses(doc, "CFG006") == ["fail"], findings(doc, "CFG006")
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_NAMING.format(name="ds.json"))
    doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")  # accelerate reads it and hands DeepSpeed a dict
    [(status, message)] = findings(doc, "CFG006")
    assert status == "warn" and "ds.json:3: key 'train_micro_batch_size_per_gpu' is given twice" in message
    assert "json.load, which keeps only this last one" in message, message


def test_a_repeated_key_in_an_accelerate_json_config_is_kept_last(capsys, tmp_path):
    text = '{"distributed_type": "NO",\n "num_processes": 1,\n "num_processes": 1}\n'
    (tmp_path / "accelerate.json").write_text(text)
    doc = lint(capsys, "--config", tmp_path / "accelerate.json")
    assert findings(doc, "CFG006") == [
        ("warn", f"{tmp_path / 'accelerate.json'}:3: key 'num_processes' is given twice; only this last one takes "
                 "effect")]


@pytest.mark.parametrize("text", ['{"a": 1}', '{"a": 1,}', '{"a": [1, 2, ], // c\n}', '\ufeff{"a": 1}',
                                  '{"a": "x,}", # c\n}', '{"a": 1,\n/* c */}', '{"a": "//", "b": "#"}'])
def test_the_deepspeed_reading_is_hjsons_and_says_what_json_load_refuses(text):
    from preflight.inputs.documents import parse_json

    doc = parse_json("ds.json", text, "DeepSpeed config", comments=True)
    assert doc.data == hjson_loads(text)
    try:
        json.loads(text)
        refused = False
    except json.JSONDecodeError:
        refused = True
    assert (doc.json_load_refusal is not None) == refused and bool(doc.hjson_only) == refused


def test_steps_per_print_inf_as_accelerate_sets_it_is_no_type_error(capsys, tmp_path):
    # accelerate's DeepSpeedPlugin sets steps_per_print to inf itself: the same written as text is not bad input
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "steps_per_print": "inf", '
                                      '"zero_optimization": {"stage": 2}}')
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_NAMING.format(name="ds.json"))
    doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    assert not [r for r in doc["results"] if r["status"] in ("fail", "error")], doc["results"]


def test_a_null_batch_key_is_not_set_as_deepspeed_reads_it(capsys, tmp_path):
    # DeepSpeed reads the batch keys with get_scalar_param (default None): null is the key left out, and the two
    # others give it (align-anything's ds_z3_offload_config.json), so CFG030 judges it with the world size
    (tmp_path / "ds.json").write_text('{"train_batch_size": 128, "train_micro_batch_size_per_gpu": 16, '
                                      '"gradient_accumulation_steps": null, "zero_optimization": {"stage": 3}}')
    doc = lint(capsys, "--deepspeed", tmp_path / "ds.json", "--world-size", "8")
    assert not [r for r in doc["results"] if r["status"] in ("fail", "error", "warn")], doc["results"]
    [batch] = [r for r in doc["results"] if r["id"] == "CFG030"]
    assert batch["status"] == "pass" and "128" in batch["message"], batch
    (tmp_path / "ds.json").write_text('{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 16, '
                                      '"gradient_accumulation_steps": null}')
    doc = lint(capsys, "--deepspeed", tmp_path / "ds.json", "--world-size", "8")
    assert [r["status"] for r in doc["results"] if r["id"] == "CFG030"] == ["fail"], doc["results"]
