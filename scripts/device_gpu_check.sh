#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and its driver: run the real NVML path once and keep what it saw.
#  1. the collector as a node runs it (python3 preflight/collector.py): its gpus fact must be available;
#  2. the real adapter (gpus.Nvml) inside the recorder of tests/nvml_fake.py: every answer it gave
#     is written to tests/fixtures/nvml/recorded-<model>.json, which the tests' fake adapter replays (the
#     GPU fabric with its cluster UUID, read whole from nvmlGpuFabricInfo, among them);
#  3. where preflight is installed with its test extra, tests/checks/test_gpu.py (its first test then takes
#     the real path, and every recording is replayed);
#  4. where torch sees two GPUs or more, peer-to-peer between every pair (scripts/p2p_probe.py: a verified copy
#     each way, bounded in time), written to p2p.json.
# It needs python3 with nvidia-ml-py: the environment's own, or pynvml.py alone carried from .venv, as in
#   run(command="scripts/device_gpu_check.sh", timeout_s=300,
#       carry=[".venv/lib/python3.11/site-packages/pynvml.py"])
# Everything it writes is copied to $OUT too, when that is set, so that the device tool brings it back.
# NVML_FAKE=h100x8.json replays a recording instead of NVML: a dry run of this script without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
if ! "$PY" -c "import pynvml" 2>/dev/null; then
    carried=$(ls .venv/lib/python3*/site-packages/pynvml.py 2>/dev/null | head -n 1 || true)
    if [ -z "$carried" ]; then
        echo "device_gpu_check: $PY cannot import pynvml: install nvidia-ml-py, or carry" \
             ".venv/lib/python3.11/site-packages/pynvml.py" >&2
        exit 2
    fi
    mkdir -p "$WORK/pynvml" && cp "$carried" "$WORK/pynvml/"
    export PYTHONPATH="$WORK/pynvml${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== 1. the collector as shipped to a node"
if [ -z "${NVML_FAKE:-}" ]; then
    "$PY" preflight/collector.py </dev/null | head -n 1 >"$WORK/facts.json"
    "$PY" - "$WORK/facts.json" <<'EOF'
import json, sys
facts = json.load(open(sys.argv[1]))
gpus = facts["gpus"]
print(json.dumps(gpus, indent=1)[:3000])
print("IMEX (GPU010):", json.dumps((facts.get("fabric") or {}).get("imex")))
if not gpus.get("available"):
    sys.exit("device_gpu_check: NVML is not available here: %s" % (gpus.get("reason") or gpus.get("error")))
EOF
fi

echo "== 2. recording the real adapter's answers"
"$PY" - "$WORK" <<'EOF'
import datetime, json, os, re, sys
sys.path[:0] = ["tests", "."]
from preflight.node import gpus
from nvml_fake import FIXTURES, Recorder, fake

adapter = fake(os.environ["NVML_FAKE"])() if os.environ.get("NVML_FAKE") else gpus.Nvml()
recorder = Recorder(adapter)
facts = gpus.facts(recorder)
try:
    from importlib.metadata import version
    binding = "nvidia-ml-py %s" % version("nvidia-ml-py")
except Exception:
    binding = "pynvml from %s" % sys.modules["pynvml"].__file__
model = facts["devices"][0]["name"] if facts["devices"] else "no-gpu"
name = "recorded-%s.json" % re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
record = dict({"source": "Recorded by scripts/device_gpu_check.sh on %s (%s x %s, driver %s, %s)" % (
    datetime.date.today(), facts["count"], model, facts["driver_version"], binding)}, **recorder.record)
gpus = ",\n".join("  " + json.dumps(g) for g in record.pop("gpus"))
head = ",\n".join(" %s: %s" % (json.dumps(k), json.dumps(v)) for k, v in record.items())
text = "{\n%s,\n \"gpus\": [\n%s\n ]\n}\n" % (head, gpus)
(FIXTURES / name).write_text(text)
open(os.path.join(sys.argv[1], name), "w").write(text)
open(os.path.join(sys.argv[1], "gpus-fact.json"), "w").write(json.dumps(facts, indent=1) + "\n")
for gpu in facts["devices"]:  # the fabric as recorded: state, status, clique, health, cluster UUID (GPU010)
    print("GPU %s fabric: %s" % (gpu["index"], json.dumps(gpu["fabric"])))
unsupported = sorted({k for g in recorder.record["gpus"] for k, v in g.items()
                      if "NotSupported" in (list(v.values()) if isinstance(v, dict) else [v])})
print("wrote %s: %d GPU(s) %s; not supported: %s" % (FIXTURES / name, facts["count"], model,
                                                      ", ".join(unsupported) or "nothing"))
EOF

echo "== 3. tests/checks/test_gpu.py"
status=0
if "$PY" -c "import pytest, yaml; from preflight import registry; assert 'GPU001' in {c.id for c in registry.load().checks}" 2>/dev/null; then
    "$PY" -m pytest -q -p no:cacheprovider tests/checks/test_gpu.py 2>&1 | tee "$WORK/pytest.log" || status=$?
else
    echo "tests not run: $PY lacks pytest, pyyaml or preflight installed (pip install -e '.[test]')"
fi
echo "== 4. GPU peer-to-peer, every pair (scripts/p2p_probe.py)"
if [ -z "${NVML_FAKE:-}" ]; then
    timeout 150 "$PY" scripts/p2p_probe.py --timeout 120 >"$WORK/p2p.json" || echo "p2p_probe: exit $? (1: a pair failed or hung, 2: nothing to probe)"
    head -c 4000 "$WORK/p2p.json"
fi
if [ -n "${OUT:-}" ]; then
    cp "$WORK"/*.json "$WORK"/*.log "$OUT"/ 2>/dev/null || true
fi
exit $status
