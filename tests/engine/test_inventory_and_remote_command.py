"""The inventory of nodes (preflight.inputs.inventory) and the remote command line that starts the node side
(preflight.remote.shipping): the interpreter's path quoted."""
import shlex

import pytest

from preflight.inputs import inventory
from preflight.inputs.documents import InputError
from preflight.remote import shipping


def test_the_remote_command_quotes_the_interpreter_path():
    hostile = "/opt/py; touch /tmp/pwned"
    words = shlex.split(shipping.shipped_command(hostile))
    # the keeper wrapper gets it as one argument ($1) and runs it only as "$1" / "$2" (quoted in its script)
    assert words[:3] == ["exec", "/bin/sh", "-c"] and words[4:6] == ["preflight", hostile]
    assert '"$1" -u -c "$2"' in words[3] and '"$2" -u -c "$3"' in words[7]


def test_inventory():
    assert inventory.expand("gpu[001-003],gpu010", "--hosts") == ["gpu001", "gpu002", "gpu003", "gpu010"]
    for bad in (["a", "a"], [], ["n1;touch /tmp/pwned"], ["a", " "]):
        with pytest.raises(InputError):
            inventory.validate(bad, "--hosts")
    with pytest.raises(InputError, match="bad host list"):
        inventory.expand("gpu[1-", "--hosts")
    assert inventory.head_first(["a", "b", "c"], "b") == ["b", "a", "c"]
    assert inventory.head_first(["a", "b"], "10.0.0.1") == ["a", "b"]
