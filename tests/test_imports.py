"""Imported prompt sources: licence and provenance recorded, malformed rows named by file and line,
benchmark overlap refused, and the mixed draw prepare-data reads (balanced, continued by --skip)."""

import gzip
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dominospec import DominoError
from dominospec.cli import main
from dominospec.data.imports import SOURCES, convert_rows, import_prompts, mixed_order, read_imported, read_sources
from dominospec.data.overlap import build_reference, find_overlaps
from dominospec.data.sources import load_prompts

REPO = Path(__file__).resolve().parents[1]
EVAL_SETS = sorted((REPO / "prompts").glob("eval-*.jsonl"))
COMMIT = "3101c7d5072418e28b9008a6636bde82a006892c"

CLEAN_MATH = [
    "A farmer plants 12 rows of beans with 9 plants in each row. How many bean plants are there?",
    "Lena saves 4 dollars a week for 13 weeks and then spends 17 dollars. How much does she have left?",
    "A train leaves at 3:15 pm and the trip takes 2 hours 50 minutes. When does it arrive?",
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def first_eval_prompt() -> str:
    return json.loads((REPO / "prompts" / "eval-chat.jsonl").read_text().splitlines()[0])["turns"][0]


def test_import_records_licence_source_and_counts(tmp_path):
    raw = write_jsonl(tmp_path / "raw" / "train.jsonl", [{"question": q, "answer": "42"} for q in CLEAN_MATH])
    out = tmp_path / "prompts"
    entry = import_prompts("gsm8k-train", raw, out, COMMIT, EVAL_SETS, report=lambda _: None)

    recorded = read_sources(out)["sources"]["gsm8k-train"]
    assert recorded == entry
    assert (entry["licence"], entry["url"], entry["commit"]) == ("MIT", SOURCES["gsm8k-train"].url, COMMIT)
    assert entry["count"] == 3 and sum(entry["categories"].values()) == 3 and entry["raw_files"] == 1
    assert entry["overlap"] == {
        "ngram": 8,
        "benchmarks": [p.name for p in EVAL_SETS],
        "overlapping": 0,
        "dropped": 0,
    }
    rows = [json.loads(line) for line in gzip.decompress((out / entry["file"]).read_bytes()).decode().splitlines()]
    assert [r["turns"][0] for r in rows] == CLEAN_MATH
    assert [r["from"] for r in rows] == ["train.jsonl:1", "train.jsonl:2", "train.jsonl:3"]


def test_import_is_byte_reproducible(tmp_path):
    raw = write_jsonl(tmp_path / "train.jsonl", [{"question": q} for q in CLEAN_MATH])
    a = import_prompts("gsm8k-train", raw, tmp_path / "a", COMMIT, EVAL_SETS, report=lambda _: None)
    b = import_prompts("gsm8k-train", raw, tmp_path / "b", COMMIT, EVAL_SETS, report=lambda _: None)
    assert a["sha256"] == b["sha256"]


def test_malformed_rows_are_named_by_file_and_line(tmp_path):
    raw = write_jsonl(
        tmp_path / "train.jsonl",
        [{"question": CLEAN_MATH[0]}, "{not json", {"question": CLEAN_MATH[1]}, {"answer": "no question"}],
    )
    messages = []
    result = convert_rows(SOURCES["gsm8k-train"], raw, report=messages.append)
    assert len(result.prompts) == 2
    assert result.malformed == [
        "train.jsonl:2: bad JSON (Expecting property name enclosed in double quotes)",
        'train.jsonl:4: "question" is missing or empty',
    ]
    assert messages[0].startswith("train.jsonl:2: bad JSON")
    with pytest.raises(DominoError, match=r"train\.jsonl:2: bad JSON"):
        convert_rows(SOURCES["gsm8k-train"], raw, on_error="fatal")
    entry = import_prompts("gsm8k-train", raw, tmp_path / "out", COMMIT, EVAL_SETS, report=lambda _: None)
    assert entry["malformed_rows"] == 2 and entry["count"] == 2


def test_malformed_items_of_a_json_array_are_named_by_the_line_they_start_on(tmp_path):
    raw = tmp_path / "codegen-instruct.json"
    raw.write_text(
        '[\n  {"instruction": "Write a C function that reverses a string.", "input": ""},\n'
        '  {"instruction": 7, "input": ""},\n  {"instruction": "Sort a list in Go.", "input": "[3, 1, 2]"}\n]\n'
    )
    result = convert_rows(SOURCES["gpteacher-codegen"], raw, report=lambda _: None)
    assert result.malformed == ['codegen-instruct.json:3: "instruction" is not text']
    assert [p["from"] for p in result.prompts] == ["codegen-instruct.json:2", "codegen-instruct.json:4"]
    assert result.prompts[1]["turns"][0] == "Sort a list in Go.\n\n[3, 1, 2]"


def test_overlap_check_refuses_a_planted_benchmark_prompt(tmp_path):
    planted = first_eval_prompt()
    rows = [{"question": q} for q in CLEAN_MATH] + [{"question": f"Quick one: {planted}"}]
    raw = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DominoError, match=r"1 prompt\(s\) overlap.*train\.jsonl:4 ~ .*eval-chat\.jsonl:1"):
        import_prompts("gsm8k-train", raw, tmp_path / "out", COMMIT, EVAL_SETS, report=lambda _: None)
    assert not (tmp_path / "out" / "gsm8k-train.jsonl.gz").exists()

    entry = import_prompts(
        "gsm8k-train", raw, tmp_path / "out", COMMIT, EVAL_SETS, drop_overlapping=True, report=lambda _: None
    )
    assert entry["count"] == 3 and entry["overlap"]["overlapping"] == entry["overlap"]["dropped"] == 1


def test_overlap_check_reads_any_benchmark_file_and_passes_a_clean_one(tmp_path):
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": "x", "solution": CLEAN_MATH[2]}])
    reference = build_reference([bench])
    prompts = [(f"p:{i}", [q]) for i, q in enumerate(CLEAN_MATH)]
    assert find_overlaps(prompts, reference) == [("p:2", f"{bench}:1")]
    assert find_overlaps(prompts[:2], reference) == []
    assert find_overlaps([("short", ["a farmer plants 12 rows of beans"])], build_reference([bench])) == []


def test_a_file_named_like_a_test_split_is_refused(tmp_path):
    raw = write_jsonl(tmp_path / "test.jsonl", [{"question": q} for q in CLEAN_MATH])
    with pytest.raises(DominoError, match="held-out"):
        import_prompts("gsm8k-train", raw, tmp_path / "out", COMMIT, EVAL_SETS, report=lambda _: None)


PASSAGE = (
    "The Marrow Valley railway opened in 1871 to carry slate from the quarries at Bryn Uchaf to the harbour at "
    "Porth Isaf. Its narrow gauge let it climb the steep valley sides, and for forty years it carried more than "
    "eighty thousand tons a year. Passenger trains ran from 1879 until the line closed in 1936, when road "
    "transport had taken most of its traffic; volunteers reopened the lower section as a heritage line in 1962."
)


def p3_row(question: str, passage: str = PASSAGE) -> dict:
    return {"prompt": f'Question: "{question}"\n\nContext: "{passage}"\n\nAnswer:\n', "completion": "x"}


def test_passage_rows_group_questions_by_passage_and_name_bad_rows(tmp_path):
    folder = tmp_path / "data_per_template"
    write_jsonl(
        folder / "adversarial_qa_dbert_question_context_answer.jsonl",
        [
            p3_row("when did the railway open?"),
            {"prompt": "Answer this: what is slate?", "completion": "a rock"},
            p3_row("what did the railway carry?"),
            p3_row("when did the railway open?"),
            p3_row("how long?", passage="Too short to work on."),
        ],
    )
    # other templates and data sets of the folder are not read, nor refused for their names
    write_jsonl(folder / "quoref_Answer_Test.jsonl", [{"prompt": "unrelated"}])
    write_jsonl(folder / "adversarial_qa_dbert_based_on.jsonl", ["{not json"])
    result = convert_rows(SOURCES["adversarialqa-train"], folder, report=lambda _: None)
    assert result.malformed == [
        "adversarial_qa_dbert_question_context_answer.jsonl:2: the prompt does not have its template's layout "
        "(passage and question)"
    ]
    first, task = result.prompts  # the short passage is left out, the repeated question asked once
    assert first["category"] == "multi-turn" and first["from"].endswith(".jsonl:1")
    assert PASSAGE in first["turns"][0] and "When did the railway open?" in first["turns"][0]
    assert first["turns"][1:] == ["What did the railway carry?"]
    assert task["category"] in ("summarise", "rewrite", "multi-turn") and PASSAGE in task["turns"][0]

    entry = import_prompts("adversarialqa-train", folder, tmp_path / "out", COMMIT, EVAL_SETS, report=lambda _: None)
    assert entry["raw_files"] == 1 and entry["licence"] == "CC-BY-SA-3.0" and entry["count"] == 2
    write_jsonl(folder / "adversarial_qa_test_question_context_answer.jsonl", [p3_row("when?")])
    with pytest.raises(DominoError, match="held-out"):
        import_prompts("adversarialqa-train", folder, tmp_path / "out", COMMIT, EVAL_SETS, report=lambda _: None)


def test_cli_imports_and_refuses_an_overlapping_source(tmp_path, capsys):
    raw = write_jsonl(tmp_path / "train.jsonl", [{"question": q} for q in CLEAN_MATH])
    args = ["import-prompts", "gsm8k-train", str(raw), "--commit", COMMIT, "--out", str(tmp_path / "p")]
    assert main(args + ["--repo", str(REPO)]) == 0
    bench = write_jsonl(tmp_path / "bench.txt", [CLEAN_MATH[1]])
    assert main(args + ["--repo", str(REPO), "--benchmark", str(bench)]) == 2
    assert "overlap benchmark prompts" in capsys.readouterr().err


def mixed_source(tmp_path) -> Path:
    """Two imported sources, three categories of unequal size."""
    out = tmp_path / "mix"
    math = [{"question": f"{q} (variant {k})"} for k in range(4) for q in CLEAN_MATH]
    import_prompts("gsm8k-train", write_jsonl(tmp_path / "g" / "train.jsonl", math), out, COMMIT, EVAL_SETS)
    dialogues = [
        {"turns": [{"speaker": "USER", "utterance": f"I need a table for {n} people near the station tonight."}]}
        | {"dialogue_id": str(n)}
        for n in range(2, 8)
    ]
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "dialogues_001.json").write_text(json.dumps(dialogues, indent=1))
    import_prompts("sgd-train", tmp_path / "s", out, COMMIT, EVAL_SETS)
    return out


def test_mixed_draw_alternates_categories_and_skip_continues_it(tmp_path):
    folder = mixed_source(tmp_path)
    _, rows = read_imported(folder)
    order = mixed_order(rows, seed=3)
    assert len(order) == sum(len(r) for r in rows.values())
    cats = [category for _, _, category in order]
    first_round = cats[: len(set(cats))]
    assert sorted(first_round) == sorted(set(cats))  # every category once before any repeats

    whole, _ = load_prompts([f"mix:{folder}:10"], seed=3)
    head, _ = load_prompts([f"mix:{folder}:4"], seed=3)
    tail, records = load_prompts([f"mix:{folder}:10"], seed=3, skip=4)
    assert [c.id for c in whole] == [c.id for c in head] + [c.id for c in tail]
    record = records[0]
    assert record["kind"] == "mix" and record["conversations"] == 6 and record["skipped"] == 4
    assert sum(s["conversations"] for s in record["sources"].values()) == 6
    assert sum(record["categories"].values()) == 6
    assert record["sources"]["gsm8k-train"]["licence"] == "MIT"
    kept = Counter(c.id.split(":")[0] for c in tail)
    assert {name: s["conversations"] for name, s in record["sources"].items()} == kept


@pytest.mark.parametrize("spec", ["mix:prompts/train", "mix:prompts/train:0", "mix::5", "mix:prompts/train:x"])
def test_a_malformed_mix_spec_is_refused_naming_it(spec):
    with pytest.raises(DominoError, match="expected mix:DIR:N"):
        load_prompts([spec])


def test_a_changed_prompt_file_is_refused(tmp_path):
    folder = mixed_source(tmp_path)
    path = folder / "sgd-train.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"turns": ["hi"], "category": "chat"}\n'))
    with pytest.raises(DominoError, match="sha256 differs"):
        load_prompts([f"mix:{folder}:4"])


def test_documentation_sections_become_text_tasks(tmp_path):
    faq = tmp_path / "faq"
    faq.mkdir()
    body = " ".join(["Python checks each name in the local scope first and then the enclosing ones."] * 5)
    (faq / "general.rst.txt").write_text(
        f"Why does my name lookup fail?\n------------------------------\n\n{body}\n\n"
        "An example follows::\n\n    x = 1\n\nShort section\n-------------\n\nToo short.\n"
    )
    result = convert_rows(SOURCES["python-docs"], tmp_path, report=lambda _: None)
    assert len(result.prompts) == 1
    prompt = result.prompts[0]
    assert prompt["category"] == "rag" and prompt["from"] == "faq/general.rst.txt:1"
    assert "Why does my name lookup fail?" in prompt["turns"][0]
    assert "x = 1" not in prompt["turns"][0] and "example follows" not in prompt["turns"][0]


@pytest.mark.parametrize("folder", ["train", "passages"])
def test_shipped_prompt_sources_are_recorded_and_share_nothing_with_the_eval_sets(folder):
    manifest, rows = read_imported(REPO / "prompts" / folder)
    for name, entry in manifest["sources"].items():
        assert entry["licence"] and entry["url"].startswith("https://") and entry["commit"], name
        assert entry["count"] == len(rows[name]) == sum(entry["categories"].values()), name
        licences = (REPO / "prompts" / folder / "LICENSES").iterdir()
        assert any(p.name.startswith(entry["licence"]) for p in licences), f"{name}: no {entry['licence']} text"
    reference = build_reference(EVAL_SETS)
    prompts = [(cid, turns) for source in rows.values() for cid, turns, _ in source]
    assert find_overlaps(prompts, reference) == []


def test_grow_data_chunks_continue_one_draw(tmp_path):
    """scripts/grow_data.sh: chunk k is prompts [k*CHUNK, (k+1)*CHUNK) of one seeded mix, its own --out."""
    env = dict(os.environ, DOMINOSPEC="echo", PYTHON=sys.executable, FEATURES=str(tmp_path))
    env.update(FIRST="2", LAST="3", CHUNK="10")
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "grow_data.sh")], env=env, capture_output=True, text=True, check=True
    ).stdout
    calls = [line.split() for line in out.splitlines() if line.startswith("prepare-data")]
    assert len(calls) == 2
    for k, call in zip((2, 3), calls):
        arg = dict(zip(call, call[1:]))
        assert arg["--prompts"] == f"mix:prompts/train:{10 * (k + 1)}" and arg["--skip"] == str(10 * k)
        assert arg["--seed"] == "21" and arg["--out"] == f"runs/data/mix-s21-c{k}"
        assert arg["--extend"] == "data/smollm2-135m" and arg["--feature-cache"] == str(tmp_path)
    env.update(PROMPTS="prompts/passages", FIRST="0", LAST="0")
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "grow_data.sh")], env=env, capture_output=True, text=True, check=True
    ).stdout
    call = next(line.split() for line in out.splitlines() if line.startswith("prepare-data"))
    arg = dict(zip(call, call[1:]))
    assert arg["--prompts"] == "mix:prompts/passages:10" and arg["--out"] == "runs/data/passages-s21-c0"
    # the last chunk ends at the folder's last prompt; a chunk past it is not run
    total = sum(entry["count"] for entry in read_sources(REPO / "prompts/passages")["sources"].values())
    env.update(CHUNK=str(total - 20), FIRST="0", LAST="5")
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "grow_data.sh")], env=env, capture_output=True, text=True, check=True
    ).stdout
    calls = [dict(zip(c, c[1:])) for c in (line.split() for line in out.splitlines()) if c[:1] == ["prepare-data"]]
    assert [(a["--skip"], a["--prompts"]) for a in calls] == [
        ("0", f"mix:prompts/passages:{total - 20}"),
        (str(total - 20), f"mix:prompts/passages:{total}"),
    ]
    assert f"holds {total} prompts, all drawn by earlier chunks; stopping" in out
