"""Bad input stops a command before training: one message naming the config key, the file or the
row, exit code 2, no traceback (`--debug` / RIDGELINE_DEBUG=1 add it). Issue 19, item 4.

The cases where the process's exit code and stderr are the point run the real `ridgeline train`
in a subprocess; the rest call `ridgeline.cli.main` in this process (the same code path, without
paying for a new interpreter each time)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ridgeline import cli


def arithmetic_row(i: int) -> dict:
    a, b = i % 10, (3 * i) % 10
    return {"data_source": "arithmetic",
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
            "env_class": "arithmetic", "reward_spec": {"method": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i}}


def write_jsonl(path: Path, rows: list, *, encoding: str = "utf-8") -> Path:
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode(encoding))
    return path


def good_rows(n: int = 16) -> list[dict]:
    return [arithmetic_row(i) for i in range(n)]


def overrides(tmp_path: Path, data: Path | str, *extra: str) -> list[str]:
    return ["+experiment=tiny", f"trainer.export_path={tmp_path / 'runs'}", f"data.train_data=[{data}]",
            "data.val_data=[]", "data.prepare=null", "trainer.eval_before_train=false", *extra]


def ridgeline_train(tmp_path: Path, data: Path | str, *extra: str, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "ridgeline.cli", "train", *overrides(tmp_path, data, *extra)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def assert_one_message(stderr: str, *fragments: str) -> None:
    """One `ridgeline: ...` message (possibly wrapped over lines), no traceback, naming each fragment."""
    assert "Traceback" not in stderr, stderr[-3000:]
    message = stderr[stderr.index("ridgeline: "):]
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ the real command
@pytest.mark.parametrize("case", ["unknown_env_in_config", "row_without_ground_truth", "misspelled_env_setting",
                                  "missing_model_folder"])
@pytest.mark.integration
def test_ridgeline_train_refuses_before_training(tmp_path, case):
    """Each of these ran to the end with exit 0 at reward 0, or ended in a traceback, before."""
    rows = good_rows()
    if case == "row_without_ground_truth":
        rows[3]["reward_spec"] = {"method": "rule"}
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    extra, fragments = {
        "unknown_env_in_config": (["environment.env_class=no_such_env"],
                                  ["environment.env_class: unknown env 'no_such_env'", "Fix:"]),
        "row_without_ground_truth": ([], [f"data.train_data: {data} row 3", "ground_truth", "Fix:"]),
        "misspelled_env_setting": (["+environment.skyrl_gym.arithmetic.format_scor=0.5"],
                                   [f"data.train_data: {data} row 0", "unknown settings ['format_scor']",
                                    "format_score"]),
        "missing_model_folder": ([f"trainer.policy.model.path={tmp_path / 'no_such_model'}"],
                                 [f"trainer.policy.model.path={tmp_path / 'no_such_model'}: no such local folder",
                                  "Fix:"]),
    }[case]
    proc = ridgeline_train(tmp_path, data, *extra)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_message(proc.stderr, *fragments)
    run_dir = tmp_path / "runs" / "tiny"
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "final_model").exists()  # nothing ran


# ------------------------------------------------------------------------ the same path, in process
def refused(capsys, argv: list[str], *fragments: str, prog: str = "ridgeline") -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: "), err
    assert_one_message(err.replace(f"{prog}: ", "ridgeline: ", 1), *fragments)
    return err


def test_environments_named_anywhere_are_checked(tmp_path, capsys):
    rows = good_rows()
    rows[5]["env_class"] = "no_such_env"
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    refused(capsys, ["train", *overrides(tmp_path, data)],
            f"data.train_data: {data} row 5, column 'env_class': unknown env 'no_such_env'", "arithmetic")
    good = write_jsonl(tmp_path / "good.jsonl", good_rows())
    # a settings block for an env nobody knows: a misspelled env name
    refused(capsys, ["train", *overrides(tmp_path, good, "environment.skyrl_gym.arithmetc.format_score=0.5")],
            "environment.skyrl_gym.arithmetc: unknown env 'arithmetc'")


def test_an_env_that_hangs_at_start_stops_the_check_not_the_run(tmp_path, capsys):
    module = tmp_path / "hanging_env.py"
    module.write_text(
        "import time\n"
        "from ridgeline.envs import SingleTurnEnv, register\n"
        "@register('hangs_at_init')\n"
        "class HangsAtInit(SingleTurnEnv):\n"
        "    def init(self, prompt):\n"
        "        time.sleep(30)\n"
        "        return prompt, {}\n"
        "    def score(self, text):\n"
        "        return 1.0\n")
    rows = [{**row, "env_class": "hangs_at_init"} for row in good_rows()]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    refused(capsys, ["train", *overrides(tmp_path, data, f"environment.env_modules=[{module}]",
                                         "environment.step_timeout_s=0.5")],
            f"data.train_data: {data} row 0: environment 'hangs_at_init' did not start and stop within "
            "environment.step_timeout_s=0.5 s")


@pytest.mark.parametrize("env_class", ["text2sql_lenient", "text2sql"])
def test_a_gold_sql_that_fails_stops_the_run_before_training(tmp_path, capsys, env_class):
    """Before: a gold SQL failing on every row trained to the end (rc 0, no warning), every reward 0."""
    import sqlite3

    db = tmp_path / "spider" / "database" / "shop" / "shop.sqlite"  # skyrl-gym's layout under its db_path
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE items (name TEXT, price REAL)")
        conn.execute("INSERT INTO items VALUES ('pen', 1.5)")
    rows = [{"prompt": [{"role": "user", "content": f"Question {i}: the cheapest item?"}], "env_class": env_class,
             "db_id": "shop", "data": "spider",
             "reward_spec": {"method": "rule", "ground_truth": "SELECT name FROM item ORDER BY price LIMIT 1"},
             "extra_info": {"db_path": str(db)}} for i in range(16)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    setting = (f"+environment.skyrl_gym.text2sql.db_path={tmp_path}" if env_class == "text2sql" else
               f"+environment.skyrl_gym.text2sql_lenient.db_root={tmp_path}")
    refused(capsys, ["train", *overrides(tmp_path, data, setting)],
            f"data.train_data: {data} row 0: environment '{env_class}' can never reward this row: its gold SQL "
            "(reward_spec.ground_truth) fails on ", "no such table: item", "Fix: the row's ground truth")


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """Model folders broken in the ways a user breaks them."""
    from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    model, tokenizer = build_tiny_model("llama", build_char_tokenizer()), build_char_tokenizer()
    (root / "no_config").mkdir()
    (root / "weights.bin").write_bytes(b"\0" * 16)
    (root / "ggufs").mkdir()
    (root / "ggufs" / "model-q4.gguf").write_bytes(b"GGUF")
    model.save_pretrained(root / "no_tokenizer")
    for name in ("bad_tokenizer", "truncated_weights"):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "bad_tokenizer" / "tokenizer.json").write_text("{not json")
    weights = root / "truncated_weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return root


@pytest.mark.parametrize("key,value,fragments", [
    ("trainer.policy.model.path", "no_config", ["the folder has no config.json"]),
    ("trainer.policy.model.path", "weights.bin", ["is a file, not a model folder"]),
    ("trainer.policy.model.path", "ggufs/model-q4.gguf",
     ["is a file", "trainer.policy.model.gguf_file=model-q4.gguf"]),
    ("trainer.policy.model.path", "ggufs", ["no config.json", "it holds model-q4.gguf",
                                            "trainer.policy.model.gguf_file=model-q4.gguf"]),
    ("trainer.policy.model.path", "no_tokenizer", ["holds no tokenizer", "tokenizer.save_pretrained"]),
    ("trainer.policy.model.path", "bad_tokenizer", ["the tokenizer could not be loaded", "JSONDecodeError"]),
    ("trainer.policy.model.path", "truncated_weights", ["the model weights could not be loaded",
                                                        "SafetensorError"]),
    ("trainer.ref.model.path", "no_config", ["the folder has no config.json"]),
    ("trainer.critic.model.path", "no_such_folder", ["no such local folder"]),
    ("trainer.policy.model.path", "tiny://nope", ["unknown tiny model 'nope'"]),
])
@pytest.mark.integration
def test_model_paths_are_refused_naming_their_key(tmp_path, capsys, model_folders, key, value, fragments):
    path = value if "://" in value else str(model_folders / value)
    extra = [f"{key}={path}"]
    if key == "trainer.critic.model.path":
        extra += ["trainer.algorithm.advantage_estimator=gae", "trainer.critic_mini_batch_size=16"]
    data = write_jsonl(tmp_path / "rows.jsonl", good_rows())
    refused(capsys, ["train", *overrides(tmp_path, data, *extra)], f"{key}={path}", *fragments)


def test_a_gguf_file_that_is_not_there_names_gguf_file(tmp_path, capsys, model_folders):
    data = write_jsonl(tmp_path / "rows.jsonl", good_rows())
    refused(capsys, ["train", *overrides(tmp_path, data, f"trainer.policy.model.path={model_folders / 'ggufs'}",
                                         "trainer.policy.model.gguf_file=model-q8.gguf")],
            "trainer.policy.model.gguf_file=model-q8.gguf: no such file")


def test_a_gguf_file_beside_a_model_built_from_its_name_is_refused(tmp_path, capsys):
    """Before: trainer.policy.model.gguf_file was silently ignored with tiny://."""
    data = write_jsonl(tmp_path / "rows.jsonl", good_rows())
    refused(capsys, ["train", *overrides(tmp_path, data, "+trainer.policy.model.gguf_file=model-q8.gguf")],
            "trainer.policy.model.gguf_file=model-q8.gguf is set, but trainer.policy.model.path=tiny://llama builds "
            "its model in memory", "Fix: remove trainer.policy.model.gguf_file")


def test_hub_ids_unreachable_or_not_cached_get_the_offline_fix(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    data = write_jsonl(tmp_path / "rows.jsonl", good_rows())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # an empty cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    hub_id = "ridgeline-tests/no-such-model"
    refused(capsys, ["train", *overrides(tmp_path, data, f"trainer.ref.model.path={hub_id}")],
            f"trainer.ref.model.path={hub_id}: no such local folder", "could not be reached",
            "HF_HUB_OFFLINE=1", "local model folder")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    refused(capsys, ["train", *overrides(tmp_path, data, f"trainer.policy.model.path={hub_id}")],
            "HF_HUB_OFFLINE is set", f"has no model '{hub_id}'", "hf download")


def test_eval_names_the_model_key_too(tmp_path, capsys):
    data = write_jsonl(tmp_path / "rows.jsonl", good_rows())
    refused(capsys, ["eval", "+experiment=tiny", f"data.val_data=[{data}]", "data.prepare=null",
                     f"trainer.policy.model.path={tmp_path / 'gone'}"],
            f"trainer.policy.model.path={tmp_path / 'gone'}: no such local folder", prog="ridgeline eval")


def parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("case", ["missing", "directory", "folder_without_data", "bad_json_line", "bad_parquet", "wrong_columns",
                                  "empty", "bad_prompt", "unsupported_suffix", "non_utf8_jsonl", "non_utf8_json_array",
                                  "fewer_rows_than_a_batch"])
def test_data_errors_are_one_message_naming_file_and_row(tmp_path, capsys, case):
    rows = good_rows()
    if case == "missing":
        data, fragments = tmp_path / "nope.jsonl", ["dataset file not found", "nope.jsonl"]
    elif case == "directory":  # named like a file
        data, fragments = tmp_path / "train.parquet", ["dataset path is a directory"]
        data.mkdir()
    elif case == "folder_without_data":  # a dataset folder (load_dataset) without data files
        data, fragments = tmp_path / "empty_folder", ["datasets.load_dataset(", "doesn't contain any data files"]
        data.mkdir()
    elif case == "bad_json_line":
        data = write_jsonl(tmp_path / "x.jsonl", rows)
        data.write_text(data.read_text().replace('"arithmetic", "prompt"', '"arithmetic" "prompt"', 1))
        fragments = [f"{data} row 0 (line 1): invalid JSON"]
    elif case == "bad_parquet":
        data = tmp_path / "x.parquet"
        data.write_bytes(b"PAR1 this is not parquet")
        fragments = [f"{data}: could not read parquet file"]
    elif case == "wrong_columns":
        data = parquet(tmp_path / "x.parquet", [{"question": "1+1?", "answer": "2"}] * 16)
        fragments = [f"{data} row 0, column 'prompt'"]   # reward_spec is optional (the env reads what it needs)
    elif case == "empty":
        data = tmp_path / "x.jsonl"
        data.write_text("\n")
        fragments = ["dataset has no rows", str(data)]
    elif case == "bad_prompt":
        rows[4]["prompt"] = "What is 1 + 1?"
        data = write_jsonl(tmp_path / "x.jsonl", rows)
        fragments = [f"{data} row 4, column 'prompt': expected a non-empty list of {{role, content}} messages"]
    elif case == "unsupported_suffix":
        data = tmp_path / "x.csv"
        data.write_text("prompt\n1+1?\n")
        fragments = ["unsupported file type '.csv'"]
    elif case == "non_utf8_jsonl":  # was a bare UnicodeDecodeError
        rows[7]["prompt"][0]["content"] = "Combien font 2 + 2 ? Réponse :"
        data = write_jsonl(tmp_path / "x.jsonl", rows, encoding="latin-1")
        fragments = [f"{data} row 7 (line 8): not UTF-8 text (byte 0xe9", "Fix:"]
    elif case == "non_utf8_json_array":
        data = tmp_path / "x.json"
        data.write_bytes(json.dumps(rows, indent=1, ensure_ascii=False).replace("What", "Wh\u00e4t", 1)
                         .encode("latin-1"))
        fragments = [f"{data} line 7: not UTF-8 text"]  # an array's rows are not lines
    else:
        data = write_jsonl(tmp_path / "x.jsonl", rows[:5])
        fragments = ["data.train_data holds 5 usable prompts, fewer than trainer.train_batch_size=16", "Fix:"]
    refused(capsys, ["train", *overrides(tmp_path, data)], "data.train_data", *fragments)


def test_rows_with_line_separators_in_their_text_load(tmp_path):
    """JSON strings may hold U+2028 unescaped; str.splitlines would have cut the row there."""
    from ridgeline.data import PromptDataset

    rows = good_rows(2)
    rows[1]["prompt"][0]["content"] = "first\u2028second\u0085third"
    data = PromptDataset([write_jsonl(tmp_path / "x.jsonl", rows)])
    assert data[1].prompt[0]["content"] == "first\u2028second\u0085third"


def test_debug_flag_and_variable_show_the_traceback(tmp_path, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "rows.jsonl", good_rows())
    argv = overrides(tmp_path, data, "environment.env_class=no_such_env")
    assert cli.main(["train", "--debug", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "EnvironmentCheckError" in err
    assert err.rstrip().splitlines()[-1].startswith("ridgeline: environment.env_class: unknown env")
    monkeypatch.setenv("RIDGELINE_DEBUG", "1")
    assert cli.main(["train", *argv]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_full_disk_is_told_apart_from_other_errors(tmp_path):
    """/dev/full answers every write with ENOSPC: a real full device, no root needed."""
    from ridgeline.errors import is_disk_full

    with pytest.raises(OSError) as info:
        with open("/dev/full", "w") as f:
            f.write("x")
            f.flush()
    assert is_disk_full(info.value)
    try:
        raise RuntimeError("file write failed") from info.value  # torch.save's wording, the errno below
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert not is_disk_full(PermissionError(13, "Permission denied"), tmp_path)
