"""config.py: the one place environment variables are declared and parsed, and where a
DDL_* variable nothing declares (a misspelling) is warned of."""

from __future__ import annotations

import pathlib
import re
import warnings
from unittest.mock import patch

import pytest

from ddlcore import config

ROOT = pathlib.Path(__file__).resolve().parents[2]
_CONFIG = ROOT / "ddlcore" / "config.py"


def test_defaults():
    env: dict[str, str] = {}
    assert config.get("DDL_TIMEOUT", env) == 600.0
    assert config.get("DDL_TRANSPORT", env) == "auto"
    assert config.get("DDL_CHUNK_BYTES", env) == 1 << 20
    assert config.get("DDL_TOPOLOGY", env) == ()
    assert config.get("DDL_DEBUG", env) is False
    assert config.get("DDL_RANK", env) is None


@pytest.mark.parametrize(
    "text,value",
    [("4096", 4096), ("64K", 65536), ("1M", 1 << 20), ("2g", 2 << 30), ("1.5K", 1536), ("0", 0)],
)
def test_sizes(text, value):
    assert config.parse_size(text) == value


@pytest.mark.parametrize(
    "name,bad",
    [
        ("DDL_TIMEOUT", "soon"),
        ("DDL_TIMEOUT", "-1"),
        ("DDL_CHUNK_BYTES", "1Q"),
        ("DDL_TOPOLOGY", "4by2"),
        ("DDL_TOPOLOGY", "4x0"),
        ("DDL_TRANSPORT", "carrier-pigeon"),
        ("DDL_TRANSPORT", "auto:tcp,ipoac"),
        ("DDL_DEBUG", "maybe"),
        ("DDL_MASTER_PORT", "70000"),
        ("DDL_RANK", "-1"),
        ("DDL_NCHANNELS", "0"),
    ],
)
def test_invalid_values_name_the_variable(name, bad):
    with pytest.raises(ValueError, match=name):
        config.get(name, {name: bad})


def test_reads_os_environ_at_call_time():
    with patch.dict("os.environ", {"DDL_TIMEOUT": "7.5", "DDL_TOPOLOGY": "4x2"}):
        assert config.get("DDL_TIMEOUT") == 7.5
        assert config.get("DDL_TOPOLOGY") == (4, 2)
    with patch.dict("os.environ", {"DDL_TRANSPORT": "auto:ucx,tcp"}):
        assert config.get("DDL_TRANSPORT") == "auto:ucx,tcp"


def test_every_variable_documented():
    for var in config.VARS.values():
        assert var.doc and var.doc[0].isupper(), var.name


def test_resolved_lists_ddl_variables():
    values = config.resolved({})
    assert "DDL_TIMEOUT" in values and "RANK" not in values
    assert "RANK" in config.resolved({}, external=True)


def test_no_other_module_reads_ddl_variables():
    """Only config.py may look a DDL_* variable up in the environment."""
    pattern = re.compile(r"""(environ(\.get|\.pop|\.setdefault)?\s*[\[(]|getenv\s*\()\s*["']DDL_""")
    offenders = []
    for folder in ("ddlcore", "transports", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "config.py" and pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"DDL_* read from the environment outside config.py: {offenders}"


def test_the_secret_is_never_shown():
    """What `python -m ddlcore info` prints (config.resolved) ends up in bug reports."""
    values = config.resolved({"DDL_SECRET": "topsecretvalue123"})
    assert "topsecretvalue123" not in repr(values)
    assert values["DDL_SECRET"] == "<set, 17 characters, not shown>"
    assert config.resolved({})["DDL_SECRET"] == ""
    assert config.get("DDL_SECRET", {"DDL_SECRET": "abc"}) == "abc"


@pytest.mark.parametrize(
    "text,mode",
    [
        ("auto", "auto"),
        (" AUTO ", "auto"),
        ("1", "1"),
        ("true", "1"),
        ("yes", "1"),
        ("0", "0"),
        ("false", "0"),
        ("off", "0"),
        ("", "0"),
    ],
)
def test_link_probe_is_auto_on_or_off(text, mode):
    assert config.get("DDL_LINK_PROBE", {}) == "auto"
    assert config.get("DDL_LINK_PROBE", {"DDL_LINK_PROBE": text}) == mode
    with pytest.raises(ValueError, match=r"DDL_LINK_PROBE='sometimes'.*auto, 1 or 0"):
        config.get("DDL_LINK_PROBE", {"DDL_LINK_PROBE": "sometimes"})


@pytest.mark.parametrize(
    "mode,hosts,env,probes",
    [
        ("auto", 1, {}, False),
        ("auto", 2, {}, True),
        ("1", 1, {}, True),
        ("0", 2, {}, False),
        # Given links win over measured ones; with both given there is nothing to measure.
        ("auto", 2, {"DDL_LINK_BW": "5e9,1e8"}, True),
        ("auto", 2, {"DDL_LINK_BW": "5e9,1e8", "DDL_LINK_LAT": "1e-6"}, False),
        ("1", 2, {"DDL_LINK_BW": "5e9,1e8", "DDL_LINK_LAT": "1e-6"}, False),
    ],
)
def test_link_probe_runs_when_the_job_spans_hosts(mode, hosts, env, probes):
    from ddlcore.job import probe

    assert probe.wanted(mode, hosts, env) is probes


def test_a_misspelled_variable_is_named_with_the_one_meant():
    found = config.unknown(
        {"DDL_TRANSPROT": "tcp", "DDL_CHUNK_BYTE": "1M", "DDL_XYZZY": "1", "DDL_TIMEOUT": "5"}
    )
    assert found == {
        "DDL_CHUNK_BYTE": "DDL_CHUNK_BYTES",
        "DDL_TRANSPROT": "DDL_TRANSPORT",
        "DDL_XYZZY": None,  # like nothing declared: no guess
    }


def test_unknown_variables_warn_once_per_process(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    env = {"DDL_TRANSPROT": "tcp", "DDL_XYZZY": "1"}
    with pytest.warns(RuntimeWarning) as caught:
        config.warn_unknown(env)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2, messages
    assert "DDL_TRANSPROT" in messages[0] and "did you mean DDL_TRANSPORT?" in messages[0]
    assert "DDL_XYZZY" in messages[1] and "did you mean" not in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second time: nothing
        config.warn_unknown(env)
        config.warn_unknown({"DDL_TIMEOUT": "5", "DDL_CI_VENV": "/tmp/v", "PATH": "/bin"})


def test_init_warns_of_a_misspelled_variable(monkeypatch):
    import ddlcore

    monkeypatch.setattr(config, "_warned", set())
    with pytest.warns(RuntimeWarning, match="DDL_TRANSPROT.*did you mean DDL_TRANSPORT"):
        ddlcore.init(environ={"DDL_TRANSPROT": "tcp"}).close()


def _ddl_names_used() -> set[str]:
    """Every DDL_* name the source, the tests and CI mention, except the native code's own
    macros (``DDL_ARENA_MAX``, ``DDL_K_*``... in .h/.pyx/.pxd/.c files and their mentions)."""
    macros = set()
    for path in [*ROOT.glob("*/**/*.h"), *ROOT.glob("*/**/*.pyx"), *ROOT.glob("*/**/*.pxd")]:
        if ".venv" not in path.parts:
            macros |= set(re.findall(r"\bDDL_[A-Z0-9_]*", path.read_text(errors="replace")))
    used = set()
    folders = ("ddlcore", "transports", "kernels", "tests", "benchmarks", ".ci", "docs")
    for folder in folders:
        for path in (ROOT / folder).rglob("*"):
            if (
                path.is_file()
                and path.suffix not in (".c", ".h", ".so", ".pyc", ".pyx", ".pxd")
                # these two misspell on purpose (config.py's doc gives an example)
                and path.resolve() not in (pathlib.Path(__file__).resolve(), _CONFIG)
            ):
                text = path.read_text(errors="ignore")
                used |= set(re.findall(r"\bDDL_[A-Z0-9_]*[A-Z0-9]\b", text))
    return used - macros


def test_every_ddl_variable_used_anywhere_is_known():
    """Launchers, CI and the tests set DDL_* variables of their own: each must be declared (or
    listed as another tool's), or the warning would fire in normal use."""
    used = _ddl_names_used()
    assert "DDL_REQUIRE_ALL" in used and "DDL_CI_VENV" in used  # the search finds them
    assert config.unknown(dict.fromkeys(used, "1")) == {}
