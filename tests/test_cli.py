"""The command line: input checked before the model loads (one line, exit code 2, the field
named), questions and paragraphs of your own, tables whole when piped, serve on a taken port."""

from __future__ import annotations

import json
import socket

import pytest

import precache
from precache.agents.cli import custom_question
from precache.agents.data import DatasetError, get_question, hotpotqa_dir, load_question_file, load_questions
from precache.agents.tools import cap_paragraph
from precache.bench import report
from precache.cli import main
from precache.methods import METHOD_REGISTRY
from precache.terminal import PIPE_WIDTH, console

QID = "5a832c3455429954d2e2ec41"  # the first dev question (Badr Hari)


@pytest.fixture
def no_model(monkeypatch):
    """Make loading a model fail loudly: a command that gets there has not checked its input first."""

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(precache, "load_model", boom)


def _one_line_error(capsys, expected: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    return err


# -- checks before the model loads --------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run", "--question", QID, "--method", "bogus"],
            "UnknownMethodError: unknown sharing method 'bogus'",
        ),
        (["eval", "--json", "x.json", "--method", "bogus"], "unknown sharing method 'bogus'"),
        (["fidelity", "--json", "x.json", "--methods", "prelrshared,bogus"], "unknown method(s) bogus"),
        (
            ["bench", "trace", "--trace", "smoke", "--methods", "bogus", "--json", "x.json"],
            "unknown method(s) bogus",
        ),
        (["bench", "decode", "--method", "bogus", "--json", "x.json"], "unknown sharing method 'bogus'"),
        (
            ["bench", "capacity", "--methods", "bogus", "--kv-cache-bytes", "1000", "--json", "x.json"],
            "bogus",
        ),
        (["bench", "episodes", "--methods", "bogus", "--json", "x.json"], "unknown method(s) bogus"),
        (["bench", "serve", "--methods", "bogus", "--json", "x.json"], "unknown sharing method 'bogus'"),
        (["run", "--question", QID, "--adapters", "qvv"], "AdapterError: no PEFT adapter folders"),
        (["eval", "--json", "x.json", "--adapters", "nowhere/"], "no PEFT adapter folders"),
        (["fidelity", "--json", "x.json", "--adapters", "qvv"], "no PEFT adapter folders"),
        (
            ["fidelity", "--json", "x.json", "--benchmark", "bogus"],
            "UnknownBenchmarkError: unknown benchmark 'bogus'",
        ),
        (["bench", "trace", "--trace", "paper_L9", "--json", "x.json"], "TraceError: no trace file paper_L9"),
        (["eval", "--json", "x.json", "--data", "missing.jsonl"], "DatasetError: no question file "),
        (["run", "--question", "nope"], "no HotpotQA question with id 'nope'"),
        (
            ["serve", "--lora-modules", "plan=/nonexistent/plan"],
            "--lora-modules plan=/nonexistent/plan: no PEFT",
        ),
        (["run", "--question", QID, "--answer", "x"], "--answer is the gold answer of a question text"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(argv, expected, no_model, capsys, tmp_path):
    argv = [str(tmp_path / a) if a.endswith((".json", ".jsonl", "/")) else a for a in argv]
    assert main(argv) == 2
    _one_line_error(capsys, expected)


def test_the_method_check_takes_what_make_method_takes():
    for name, registered in [
        ("prelrshared", "prelrshared"),
        ("ReBaseShared_LP", "rebaseshared-lp"),
        ("rebaseshared", "rebaseshared-lp"),
        (" NonShared ", "nonshared"),
    ]:
        assert METHOD_REGISTRY.canonical(name) == registered
        assert METHOD_REGISTRY[name] is METHOD_REGISTRY[registered]
    assert METHOD_REGISTRY.names == precache.METHODS and "rebaseshared" in METHOD_REGISTRY.choices
    with pytest.raises(precache.errors.UnknownMethodError, match="methods: nonshared, fullshared"):
        METHOD_REGISTRY.canonical("prelr")
    with pytest.raises(precache.errors.UnknownMethodError, match=r"unknown method\(s\) prelr, x \(methods: "):
        METHOD_REGISTRY.canonical_many(["PreLRShared", "prelr", "x"])


# -- --paragraphs ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            [["Badr Hari", "Badr Hari is a kickboxer."]],
            "field 'context[0][1]' must be a non-empty list of sentence",
        ),
        ([["Badr Hari"]], "field 'context[0]' must be a [title, [sentence, ...]] pair"),
        ([[3, ["x."]]], "field 'context[0][0]' (title) must be a non-empty string"),
        ([["A", ["x."]], ["A", ["y."]]], "field 'context[1][0]': title 'A' appears twice"),
        ([["A", ["x.", 3]]], "field 'context[0][1]' must be a non-empty list of sentence strings"),
        ([], "field 'context' must be a non-empty list"),
        ({"Badr Hari": ["x."]}, "field(s) 'Badr Hari' are not read by --paragraphs"),
        (
            {"context": "x"},
            "field 'context' must be a non-empty list of [title, [sentence, ...]] pairs, got str",
        ),
    ],
)
def test_paragraphs_of_the_wrong_shape_name_the_field(content, expected, tmp_path, no_model, capsys):
    path = tmp_path / "paragraphs.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DatasetError) as info:
        custom_question("Who?", path, "")
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value)
    assert main(["run", "--question", "Who?", "--paragraphs", str(path)]) == 2
    _one_line_error(capsys, expected)


def test_paragraphs_file_missing_or_not_json(tmp_path):
    with pytest.raises(DatasetError, match="no paragraphs file .*nope.json"):
        custom_question("Who?", tmp_path / "nope.json", "")
    (tmp_path / "bad.json").write_text("[[")
    with pytest.raises(DatasetError, match=r"bad.json: not JSON"):
        custom_question("Who?", tmp_path / "bad.json", "")


def test_plain_sentences_read_as_hotpotqa_joins_its_own(tmp_path):
    question = get_question(QID)
    # HotpotQA's later sentences start with a space; a user's plain sentences do not
    plain = [[title, [s.strip() for s in sentences]] for title, sentences in question.context]
    assert any(s != s.strip() for _, sentences in question.context for s in sentences)
    path = tmp_path / "paragraphs.json"
    path.write_text(json.dumps({"context": plain}))
    custom = custom_question(question.question, path, question.answer)
    # HotpotQA's splitter left no space before one `<ref>` tag in paragraph 6; every other
    # boundary of its sentences carries one, and the plain sentences get exactly those back
    spaced = [i for i, (_, ss) in enumerate(question.context) if all(b[:1] == " " for b in ss[1:])]
    assert spaced == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert [custom.context[i] for i in spaced] == [question.context[i] for i in spaced]
    assert custom.context[6][1][3] == " " + question.context[6][1][3]
    assert custom.context[4][0] == "Badr Hari"
    # what Retrieve[Badr Hari] shows: HotpotQA's text, not the plain sentences glued together
    assert cap_paragraph(custom.context[4][1]) == cap_paragraph(question.context[4][1])
    assert cap_paragraph(plain[4][1]) != cap_paragraph(question.context[4][1])


# -- eval --data ----------------------------------------------------------------------------------
def test_hotpotqa_records_read_back_as_the_shipped_questions(tmp_path):
    lines = (hotpotqa_dir() / "easy.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    shipped = [q for q in load_questions("all") if q.level == "easy"]
    assert load_question_file(path) == shipped
    # HotpotQA's own files: a JSON list of records, the id spelled `_id`
    records = [json.loads(line) for line in lines[:3]]
    for record in records:
        record["_id"] = record.pop("id")
    listed = tmp_path / "hotpot_dev.json"
    listed.write_text(json.dumps(records))
    assert load_question_file(listed) == shipped[:3]


def _record(**changes) -> dict:
    row = {
        "id": "q1",
        "question": "Who?",
        "answer": "Badr Hari",
        "context": [["Badr Hari", ["Badr Hari is a kickboxer.", " He fights."]]],
    }
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (
            json.dumps(_record(id="q2", answer=None)),
            "line 3: field 'answer' must be a non-empty string, got null",
        ),
        (
            json.dumps(_record(id="q2", question=7)),
            "line 3: field 'question' must be a non-empty string, got int",
        ),
        (json.dumps(_record(id=None)), "line 3: field 'id' must be a non-empty string"),
        (json.dumps(_record()), "line 3: field 'id': 'q1' repeats ("),
        (
            json.dumps(_record(id="q2", context=[["T", "x"]])),
            "line 3: field 'context[0][1]' must be a non-empty",
        ),
        (json.dumps(_record(id="q2", supporting_facts=[["T", "1"]])), "line 3: field 'supporting_facts'"),
        (json.dumps(_record(id="q2", hint="x")), "line 3: field(s) 'hint' are not HotpotQA fields"),
        (json.dumps(_record(id="q2", _id="q3")), "line 3: fields 'id' and '_id' differ"),
        ("[1, 2]", "line 3: a record must be a JSON object, got list"),
        ("{oops", "line 3: not a JSON object"),
    ],
)
def test_question_file_errors_name_the_line_and_the_field(bad, expected, tmp_path, no_model, capsys):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps(_record()) + "\n\n" + bad + "\n")
    with pytest.raises(DatasetError) as info:
        load_question_file(path)
    assert str(info.value).startswith(f"{path} line 3: ") and expected in str(info.value)
    assert main(["eval", "--data", str(path), "--json", str(tmp_path / "r.json")]) == 2
    _one_line_error(capsys, expected)


def test_an_empty_question_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no questions in .*empty.jsonl"):
        load_question_file(tmp_path / "empty.jsonl")


# -- output -----------------------------------------------------------------------------------------
def test_tables_print_whole_when_piped(capsys):
    names = ("nonshared", "rebaseshared-lp")
    summary = {k: 0.123456 for k, _, _ in report.FIDELITY_COLUMNS} | {"em": 0.123456, "f1": 0.123456}
    result = {"methods": dict.fromkeys(names, summary)}  # no "metrics": HotpotQA's EM and F1
    out = console()  # stdout is captured here, as in a pipe
    assert not out.is_terminal and out.width == PIPE_WIDTH
    out.print(report.fidelity_table(result))
    lines = capsys.readouterr().out.splitlines()
    header = [line for line in lines if "method" in line]
    assert len(header) == 1 and all(h in header[0] for _, h, _ in report.FIDELITY_COLUMNS)
    assert "EM" in header[0] and "F1" in header[0]
    row = [line for line in lines if "rebaseshared-lp" in line]
    assert len(row) == 1 and row[0].count("1.23e-01") == 4 and row[0].count("0.123") == 5
    assert len(header[0]) > 80  # what rich's 80 columns of a pipe would have cut


def test_serve_on_a_taken_port_is_one_line_and_exit_2(no_model, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = _one_line_error(capsys, f"BindError: cannot bind 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in err and "serving" not in err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"precache {precache.__version__}"


def test_python_dash_m_precache_is_the_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "precache", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"precache {precache.__version__}"


def test_one_v_keeps_transformers_config_dumps_quiet():
    import logging

    from transformers.utils import logging as hf_logging

    from precache.cli import set_verbosity

    try:
        set_verbosity(1)
        assert logging.getLogger().level == logging.INFO
        assert hf_logging.get_verbosity() == logging.WARNING  # its INFO dumps every config it reads
        set_verbosity(2)
        assert hf_logging.get_verbosity() == logging.DEBUG
    finally:
        set_verbosity(0)


@pytest.mark.parametrize("flags", [["--max-loras", "4"], ["--max-lora-rank", "32"]])
def test_serve_refuses_adapter_room_flags_without_runtime_loading(no_model, capsys, flags):
    """Without --enable-runtime-lora nothing can use the reserved room: refused before loading."""
    assert main(["serve", *flags]) == 2
    err = _one_line_error(capsys, f"AdapterError: {flags[0]}: only with --enable-runtime-lora")
    assert "serving" not in err
