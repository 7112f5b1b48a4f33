"""preflight.node.pickled: a checkpoint's plain data read without unpickling it. What torch.save writes is read
back as the data it holds; what a hostile pickle would run is never run."""
import io
import os
import pickle
import zipfile

import pytest

from preflight.node.pickled import Opaque, plain_data


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_comes_back_as_pickle_wrote_it(protocol):
    data = {"dp_world_size": 2, "ds_version": "0.19.8", "ratio": 0.5, "flags": [True, False, None],
            "nested": {"zero_optimization": {"stage": 3}, "big": 2 ** 70, "neg": -3}, "pair": (1, "a"),
            "empty": {}, "shared": ["x"] * 3}
    if protocol >= 3:  # protocol 2 writes bytes as a call of _codecs.encode: an Opaque here
        data["bytes"] = b"\x00\x01"
    assert plain_data(pickle.dumps(data, protocol=protocol)) == data


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/preflight-pickled-was-run",))


def test_what_a_pickle_would_call_is_a_placeholder_and_never_called(tmp_path):
    marker = "/tmp/preflight-pickled-was-run"
    if os.path.exists(marker):
        os.unlink(marker)
    read = plain_data(pickle.dumps({"payload": Evil(), "dp_world_size": 4}))
    assert read["dp_world_size"] == 4 and isinstance(read["payload"], Opaque)
    assert read["payload"].name in ("posix.system", "os.system")
    assert read["payload"].args == ("touch /tmp/preflight-pickled-was-run",)
    assert not os.path.exists(marker)


def test_what_torch_save_writes_in_its_zip_is_read_back_with_its_tensors_opaque():
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    torch.save({"module": {"w": torch.zeros(2, 3)}, "dp_world_size": 3, "zero_stage": 2}, buffer)
    archive = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    [pkl] = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    read = plain_data(archive.read(pkl))
    assert read["dp_world_size"] == 3 and read["zero_stage"] == 2
    assert isinstance(read["module"]["w"], Opaque) and read["module"]["w"].name.startswith("torch._utils.")


@pytest.mark.parametrize("stream", [b"", b"\x80\x05", b"garbage", pickle.dumps([1, 2])[:-1], b"\x80\x02c" + b"a" * 64,
                                    pickle.dumps({"k": 1}).replace(b"}", b"e", 1)])
def test_a_stream_that_is_not_a_whole_pickle_is_none_never_an_exception(stream):
    read = plain_data(stream)
    assert read is None or isinstance(read, (dict, list, int, str))
