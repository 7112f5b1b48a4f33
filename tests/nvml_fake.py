"""Recorded NVML answers: a stand-in for preflight.gpus.Nvml that replays them, and the recorder
that makes a recording from the real adapter on a machine with GPUs (scripts/device_gpu_check.sh).

A recording (tests/fixtures/nvml/*.json) holds what each method of the adapter answered:
  {"driver_version": ..., "cuda_driver_version": ..., "count": N,
   "gpus": [{METHOD: VALUE, or {ARGUMENT: VALUE} for methods with an argument}, ...]}
"NotSupported" stands for NvmlUnsupported, {"nvml_error": "GpuIsLost"} for that pynvml error (a whole
GPU can be one). A variant names a "base" recording and changes some of it: "gpus" maps an index to
the values that differ, "all_gpus" changes every GPU. {"init_error": NAME} makes nvmlInit fail.
"""
import copy
import json
import pathlib

import pynvml

from preflight.node import gpus

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "nvml"
NOT_SUPPORTED = "NotSupported"


def merge(base, change):
    if not (isinstance(base, dict) and isinstance(change, dict)) or "nvml_error" in change:
        return copy.deepcopy(change)
    merged = dict(base)
    for key, value in change.items():
        merged[key] = merge(base.get(key), value)
    return merged


def load(name):
    doc = json.loads((FIXTURES / name).read_text())
    if "base" not in doc:
        return doc
    record = load(doc["base"])
    for key in ("driver_version", "cuda_driver_version", "init_error"):
        if key in doc:
            record[key] = doc[key]
    record["gpus"] = [merge(merge(gpu, doc.get("all_gpus", {})), doc.get("gpus", {}).get(str(i), {}))
                      for i, gpu in enumerate(record["gpus"])]
    return record


def nvml_error(name):
    return getattr(pynvml, "NVMLError_" + name)()


def fake(name):
    """A class that stands where gpus.Nvml stands, answering from the recording `name`."""
    record = load(name)

    class FakeNvml(object):
        def __init__(self):
            if "init_error" in record:
                raise nvml_error(record["init_error"])
            self.closed = False

        def close(self):
            self.closed = True

        def __getattr__(self, method):
            def call(*args):
                if not args:
                    value = record[method] if method != "count" else record.get("count", len(record["gpus"]))
                else:
                    value = record["gpus"][args[0]]
                    for key in (method,) + args[1:]:
                        if value == NOT_SUPPORTED or (isinstance(value, dict) and "nvml_error" in value):
                            break
                        value = value[key]
                if value == NOT_SUPPORTED:
                    raise gpus.NvmlUnsupported(method)
                if isinstance(value, dict) and "nvml_error" in value:
                    raise nvml_error(value["nvml_error"])
                return copy.deepcopy(value)

            return call

    FakeNvml.__name__ = "FakeNvml[%s]" % name
    return FakeNvml


class Recorder(object):
    """Wraps the real adapter; every answer it gives is kept in `record`, in the recordings' format."""

    def __init__(self, real):
        self.real, self.record = real, {"gpus": []}

    def close(self):
        self.real.close()

    def __getattr__(self, method):
        function = getattr(self.real, method)

        def call(*args):
            try:
                value = result = function(*args)
            except gpus.NvmlUnsupported:
                value, result = NOT_SUPPORTED, None
            except pynvml.NVMLError as exc:
                value, result = {"nvml_error": type(exc).__name__[len("NVMLError_"):]}, exc
            if not args:
                self.record[method] = value
            else:
                while len(self.record["gpus"]) <= args[0]:
                    self.record["gpus"].append({})
                slot, keys = self.record["gpus"][args[0]], (method,) + args[1:]
                for key in keys[:-1]:
                    slot = slot.setdefault(key, {})
                slot[keys[-1]] = value
            if value == NOT_SUPPORTED:
                raise gpus.NvmlUnsupported(method)
            if isinstance(result, Exception):
                raise result
            return result

        return call
