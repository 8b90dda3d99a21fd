"""Data: preparing GSM8K/arithmetic, row validation, loading (files, .json as SkyRL writes it,
dataset folders and hub `name:split` names through datasets.load_dataset), filtering and batching."""

from __future__ import annotations

import http.server
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ridgeline.data import DatasetError, PromptDataset, PromptRow, prepare_arithmetic, prepare_gsm8k, validate_row
from ridgeline.data import sources
from ridgeline.data.cli import add_prepare_parser, main as cli_main, run_prepare
from ridgeline.data.sources import parse_dataset_name
from conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO.parent / "shared/data/gsm8k"


def good_row(**overrides) -> dict:
    row = {
        "data_source": "unit",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}],
        "env_class": "arithmetic",
        "reward_spec": {"method": "rule", "ground_truth": "2"},
        "extra_info": {"index": 0},
    }
    row.update(overrides)
    return row


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_table(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# --- prepare_gsm8k --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory) -> dict[str, Path]:
    if not GSM8K_DIR.is_dir():
        pytest.skip(f"shared GSM8K files not found at {GSM8K_DIR}")
    return prepare_gsm8k(tmp_path_factory.mktemp("gsm8k"), input_dir=GSM8K_DIR)


def test_prepare_gsm8k_counts_and_rows(gsm8k_files) -> None:
    assert set(gsm8k_files) == {"train", "validation"}
    assert gsm8k_files["train"].name == "train.parquet"
    assert gsm8k_files["validation"].name == "validation.parquet"
    train, val = read_table(gsm8k_files["train"]), read_table(gsm8k_files["validation"])
    assert (len(train), len(val)) == (7473, 1319)

    with (GSM8K_DIR / "train.jsonl").open() as handle:
        first_source = json.loads(handle.readline())
    row = train[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["env_class"] == "gsm8k"
    assert row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"].startswith(first_source["question"])
    assert "####" in row["prompt"][0]["content"]
    assert row["reward_spec"] == {"method": "rule", "ground_truth": first_source["answer"].split("####")[-1].strip()}
    assert row["extra_info"] == {
        "split": "train",
        "index": 0,
        "answer": first_source["answer"],
        "question": first_source["question"],
    }
    assert val[5]["extra_info"]["split"] == "test" and val[5]["extra_info"]["index"] == 5


def test_prepare_gsm8k_ground_truths(gsm8k_files) -> None:
    for row in read_table(gsm8k_files["train"]):
        expected = row["extra_info"]["answer"].split("####")[-1].strip().replace(",", "")
        assert row["reward_spec"]["ground_truth"] == expected
        assert re.fullmatch(r"-?\d+(\.\d+)?", expected)
    # Answers with thousands separators are stripped ("#### 1,000" -> "1000").
    assert any("," in r["extra_info"]["answer"].split("####")[-1] for r in read_table(gsm8k_files["train"]))


def test_prepared_gsm8k_is_loadable_and_rewards_reference_answers(gsm8k_files) -> None:
    from ridgeline.envs import make

    dataset = PromptDataset([gsm8k_files["validation"]])
    assert len(dataset) == 1319 and dataset.data_sources() == ["openai/gsm8k"]
    for row in list(dataset)[:200]:
        env = make(row.env_class, extras=row.extras)
        assert env.step(row.extra_info["answer"]).reward == 1.0


def test_prepare_gsm8k_env_class(tmp_path) -> None:
    from ridgeline.envs import make

    (tmp_path / "in").mkdir()
    for split in ("train", "test"):
        write_jsonl(tmp_path / "in" / f"{split}.jsonl", [{"question": "q", "answer": "2 + 3 = 5\n#### 5"}])
    for env_class, reward in (("gsm8k", 0.0), ("gsm8k_lenient", 1.0)):  # "#### 5.0" is 5 only to the lenient one
        files = prepare_gsm8k(tmp_path / env_class, input_dir=tmp_path / "in", env_class=env_class)
        [row] = PromptDataset([files["train"]])
        assert row.env_class == env_class
        assert make(row.env_class, extras=row.extras).step("#### 5.0").reward == reward


def test_prepare_gsm8k_bad_input(tmp_path) -> None:
    (tmp_path / "in").mkdir()
    with pytest.raises(DatasetError, match="train.jsonl"):
        prepare_gsm8k(tmp_path / "out", input_dir=tmp_path / "in")
    write_jsonl(tmp_path / "in" / "train.jsonl", [{"question": "q", "answer": "a\n#### 5"}])
    write_jsonl(tmp_path / "in" / "test.jsonl", [{"question": "q", "answer": "a"}, {"question": "q", "answer": "a"}])
    with pytest.raises(DatasetError, match=r"test.jsonl row 0, column 'answer'"):
        prepare_gsm8k(tmp_path / "out", input_dir=tmp_path / "in")


# --- prepare_arithmetic ---------------------------------------------------------------------


def arith_rows(out: Path, **kwargs) -> tuple[list[dict], list[dict]]:
    files = prepare_arithmetic(out, **kwargs)
    return read_table(files["train"]), read_table(files["validation"])


def test_prepare_arithmetic_defaults(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        train, val = arith_rows(tmp_path)
    assert (len(train), len(val)) == (2000, 200)
    # 30 x 30 = 900 sums; 200 held out leaves 700, so train repeats and says so.
    assert "repeats" in caplog.text
    assert len({r["extra_info"]["expression"] for r in train}) == 700
    row = val[0]
    assert row["data_source"] == "arithmetic" and row["env_class"] == "arithmetic"
    expr = row["extra_info"]["expression"]
    assert row["prompt"] == [{"role": "user", "content": f"What is {expr}? Answer with just the number."}]
    assert row["extra_info"]["split"] == "validation" and row["extra_info"]["index"] == 0
    assert row["reward_spec"]["method"] == "rule"


def test_prepare_arithmetic_deterministic(tmp_path) -> None:
    kwargs = dict(num_train=300, num_val=50, max_operand=99, ops="+-*", num_operands=3)
    a = arith_rows(tmp_path / "a", seed=7, **kwargs)
    b = arith_rows(tmp_path / "b", seed=7, **kwargs)
    c = arith_rows(tmp_path / "c", seed=8, **kwargs)
    assert a == b
    assert (tmp_path / "a/train.parquet").read_bytes() == (tmp_path / "b/train.parquet").read_bytes()
    assert a[0] != c[0] and a[1] != c[1]


def test_prepare_arithmetic_validation_independent_of_num_train(tmp_path) -> None:
    _, val_small = arith_rows(tmp_path / "a", num_train=10, num_val=40, max_operand=50)
    _, val_large = arith_rows(tmp_path / "b", num_train=500, num_val=40, max_operand=50)
    assert val_small == val_large


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_train=500, num_val=100, max_operand=99),  # rejection-sampling regime
        dict(num_train=50, num_val=30, max_operand=8),  # listing regime: 64 problems, 80 wanted -> repeats
        dict(num_train=400, num_val=100, max_operand=20, ops="+-*", num_operands=3),
    ],
)
def test_prepare_arithmetic_no_overlap_and_correct_answers(tmp_path, kwargs) -> None:
    train, val = arith_rows(tmp_path, **kwargs)
    train_exprs = {r["extra_info"]["expression"] for r in train}
    val_exprs = [r["extra_info"]["expression"] for r in val]
    assert len(val_exprs) == len(set(val_exprs)) == kwargs["num_val"]
    assert not train_exprs & set(val_exprs)
    assert len(train) == kwargs["num_train"]
    for row in train + val:
        expr = row["extra_info"]["expression"]
        assert row["reward_spec"]["ground_truth"] == str(eval(expr))  # noqa: S307  (we generated it)


def test_prepare_arithmetic_knobs(tmp_path) -> None:
    train, _ = arith_rows(
        tmp_path, num_train=300, num_val=20, min_operand=100, max_operand=999, ops="+-", num_operands=4,
        prompt_style="hash",
    )
    seen_ops = set()
    for row in train:
        tokens = row["extra_info"]["expression"].split(" ")
        operands, operators = tokens[0::2], tokens[1::2]
        assert len(operands) == 4
        assert all(100 <= int(x) <= 999 for x in operands)
        assert set(operators) <= {"+", "-"}
        seen_ops |= set(operators)
        assert row["prompt"][0]["content"].endswith('Give the final answer after "####".')
    assert seen_ops == {"+", "-"}
    assert any(int(r["reward_spec"]["ground_truth"]) < 0 for r in train)


def test_prepare_arithmetic_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="only 9 distinct problems"):
        prepare_arithmetic(tmp_path, num_val=9, max_operand=3)
    with pytest.raises(ValueError, match="ops"):
        prepare_arithmetic(tmp_path, ops="/")
    with pytest.raises(ValueError, match="prompt_style"):
        prepare_arithmetic(tmp_path, prompt_style="cot")
    with pytest.raises(ValueError, match="num_operands"):
        prepare_arithmetic(tmp_path, num_operands=1)


def test_prepared_arithmetic_rewards_ground_truth(tmp_path) -> None:
    from ridgeline.envs import make

    files = prepare_arithmetic(tmp_path, num_train=20, num_val=5, ops="+-*", num_operands=3)
    for row in PromptDataset([files["train"]], default_env_class="gsm8k"):
        gt = row.reward_spec["ground_truth"]
        env = make(row.env_class, extras=row.extras)
        assert env.step(f"{row.extra_info['expression']} = {gt}").reward == 1.0
        assert env.step(f"{int(gt) + 1}").reward == 0.0


# --- validation errors ----------------------------------------------------------------------


def test_validate_row_ok_and_extras() -> None:
    row = validate_row(good_row(custom="x"), file="train.parquet", index=3)
    assert isinstance(row, PromptRow)
    assert row.env_class == "arithmetic"
    assert set(row.extras) == {"data_source", "reward_spec", "extra_info", "custom"}
    assert row.extras["custom"] == "x"


def test_validate_row_defaults() -> None:
    raw = good_row(env_class=None)
    del raw["extra_info"]
    del raw["data_source"]
    row = validate_row(raw, file="/data/train.parquet", index=0, default_env_class="gsm8k")
    assert row.env_class == "gsm8k" and row.extra_info == {} and row.data_source == "train"
    with pytest.raises(DatasetError, match="env_class"):
        validate_row(good_row(env_class=None), file="f.jsonl", index=0)


def test_validate_row_bad_prompt_message() -> None:
    with pytest.raises(DatasetError) as info:
        validate_row(good_row(prompt="What is 1 + 1?"), file="train.parquet", index=17)
    message = str(info.value)
    assert message.startswith("train.parquet row 17, column 'prompt': expected a non-empty list of {role, content}")
    assert "got str" in message
    assert (info.value.file, info.value.index, info.value.column) == ("train.parquet", 17, "prompt")


@pytest.mark.parametrize(
    "overrides, column, fragment",
    [
        (dict(prompt=[]), "prompt", "empty list"),
        (dict(prompt=[{"role": "robot", "content": "hi"}]), "prompt", "role"),
        (dict(prompt=[{"role": "user", "content": 5}]), "prompt", "content"),
        (dict(prompt=["hi"]), "prompt", "message 0"),
        (dict(reward_spec="42"), "reward_spec", "got str"),
        (dict(extra_info=[1, 2]), "extra_info", "expected a dict"),
        (dict(env_class=3), "env_class", "got int"),
        (dict(data_source=["x"]), "data_source", "got list"),
    ],
)
def test_validate_row_errors(overrides, column, fragment) -> None:
    with pytest.raises(DatasetError) as info:
        validate_row(good_row(**overrides), file="x.jsonl", index=2)
    assert info.value.column == column
    assert f"x.jsonl row 2, column '{column}'" in str(info.value)
    assert fragment in str(info.value)


def test_validate_row_reports_all_problems() -> None:
    raw = good_row(prompt="oops", env_class=7, reward_spec=[1])
    with pytest.raises(DatasetError) as info:
        validate_row(raw, file="x.jsonl", index=4)
    message = str(info.value)
    assert "x.jsonl row 4 has 3 problems" in message
    assert all(f"column '{c}'" in message for c in ("prompt", "env_class", "reward_spec"))


# --- PromptDataset --------------------------------------------------------------------------


def test_dataset_reads_jsonl_and_parquet(tmp_path) -> None:
    jsonl = write_jsonl(tmp_path / "a.jsonl", [good_row(data_source="a", extra_info={"index": i}) for i in range(3)])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([good_row(data_source="b", env_class=None)]), parquet)
    dataset = PromptDataset([jsonl, str(parquet)], default_env_class="gsm8k")
    assert len(dataset) == 4
    assert dataset.files == [str(jsonl), str(parquet)]
    assert dataset.data_sources() == ["a", "b"]
    assert [r.extra_info.get("index") for r in dataset][:3] == [0, 1, 2]
    assert dataset[3].env_class == "gsm8k"
    assert dataset[0].prompt[1] == {"role": "user", "content": "What is 1 + 1?"}


def test_dataset_reads_pandas_and_datasets_parquet(tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    rows = [good_row(extra_info={"index": i, "note": "n"}) for i in range(4)]
    pd.DataFrame(rows, index=[10, 11, 12, 13]).to_parquet(tmp_path / "pandas.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hf.parquet"))
    for name in ("pandas.parquet", "hf.parquet"):
        dataset = PromptDataset([tmp_path / name])
        assert len(dataset) == 4
        assert dataset[2].prompt == rows[2]["prompt"]
        assert dataset[2].extra_info == {"index": 2, "note": "n"}
        assert set(dataset[2].extras) == {"data_source", "reward_spec", "extra_info"}


def test_dataset_error_names_file_row_column(tmp_path) -> None:
    rows = [good_row() for _ in range(5)]
    rows[3] = good_row(prompt="not a list")
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DatasetError, match=r"train\.jsonl row 3, column 'prompt': expected a non-empty list"):
        PromptDataset([path])

    bad = write_jsonl(tmp_path / "bad_spec.jsonl", [good_row(), good_row(reward_spec="rule")])
    with pytest.raises(DatasetError, match=r"bad_spec\.jsonl row 1, column 'reward_spec'"):
        PromptDataset([bad])


def test_row_without_reward_spec_keeps_its_columns_as_extras(tmp_path) -> None:
    """SkyRL passes a row's columns to its env as they are: DAPO-Math / AIME rows carry reward_model
    (skyrl-gym's aime env reads extras['reward_model']), not reward_spec."""
    row = {k: v for k, v in good_row().items() if k != "reward_spec"}
    row["reward_model"] = {"style": "rule", "ground_truth": "34"}
    path = write_jsonl(tmp_path / "train.jsonl", [row])
    (loaded,) = PromptDataset([path])
    assert loaded.reward_spec is None and "reward_spec" not in loaded.extras
    assert loaded.extras["reward_model"] == {"style": "rule", "ground_truth": "34"}


def test_dataset_missing_file_and_bad_jsonl(tmp_path) -> None:
    missing = tmp_path / "nope" / "train.parquet"
    with pytest.raises(DatasetError, match=re.escape(str(missing))):
        PromptDataset([missing])
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good_row()) + "\n\n" + "{not json\n")
    with pytest.raises(DatasetError, match=r"bad\.jsonl row 1 \(line 3\): invalid JSON"):
        PromptDataset([path])
    with pytest.raises(DatasetError, match="unsupported file type"):
        PromptDataset([write_jsonl(tmp_path / "rows.csv", [good_row()])])
    with pytest.raises(DatasetError, match="no rows"):
        PromptDataset([write_jsonl(tmp_path / "empty.jsonl", [])])


# --- .json files and load_dataset names (SkyRL's data.train_data entries) --------------------------


def skyrl_rows(count: int) -> list[dict]:
    return [good_row(data_source="skyrl", extra_info={"index": i, "split": "train"}) for i in range(count)]


def test_json_files_as_skyrl_writes_them(tmp_path) -> None:
    """SkyRL reads .json / .jsonl with datasets.load_dataset("json"): JSON lines (Dataset.to_json)
    or one array of rows (DataFrame.to_json(orient="records"), as its livecodebench example writes).
    Both read here to the same rows as there."""
    pd = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    rows = skyrl_rows(5)
    files = {"records.json": lambda p: pd.DataFrame(rows).to_json(p, orient="records"),
             "lines.json": lambda p: datasets.Dataset.from_list(rows).to_json(str(p)),
             "indented.json": lambda p: p.write_text(json.dumps(rows, indent=2)),
             "array.jsonl": lambda p: p.write_text(json.dumps(rows))}
    for name, write in files.items():
        write(tmp_path / name)
        dataset = PromptDataset([tmp_path / name])
        theirs = datasets.load_dataset("json", data_files=str(tmp_path / name), cache_dir=str(tmp_path / "hf"))["train"]
        assert [r.prompt for r in dataset] == [r["prompt"] for r in theirs] == [r["prompt"] for r in rows], name
        assert [r.extra_info for r in dataset] == [r["extra_info"] for r in rows], name
        assert dataset[4].reward_spec == {"method": "rule", "ground_truth": "2"}
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"prompt": []},\n  oops\n]')
    with pytest.raises(DatasetError, match=r"bad\.json \(a JSON array\): invalid JSON at line 3, column 3"):
        PromptDataset([bad])
    (tmp_path / "numbers.json").write_text("[1, 2]")
    with pytest.raises(DatasetError, match=r"numbers\.json row 0: expected a row object"):
        PromptDataset([tmp_path / "numbers.json"])


def test_dataset_names_split_at_the_first_colon() -> None:
    assert parse_dataset_name("openai/gsm8k") == ("openai/gsm8k", "train")  # SkyRL's default split
    assert parse_dataset_name("openai/gsm8k:test") == ("openai/gsm8k", "test")
    assert parse_dataset_name("data/folder:validation") == ("data/folder", "validation")
    assert parse_dataset_name("a:b:c") == ("a", "b:c")
    assert parse_dataset_name("a:") == ("a", "")


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch) -> Path:
    """load_dataset's cache in the test's folder, not the user's."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return tmp_path / "hf_cache"


def test_a_dataset_folder_loads_through_load_dataset_with_its_split(tmp_path, hf_cache) -> None:
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", skyrl_rows(3))
    write_jsonl(folder / "test.jsonl", [good_row(data_source="held-out")])
    train = PromptDataset([str(folder)], config_key="data.train_data")
    test = PromptDataset([f"{folder}:test"], config_key="data.val_data")
    assert len(train) == 3 and [r.extra_info["index"] for r in train] == [0, 1, 2]
    assert test.data_sources() == ["held-out"] and test[0].env_class == "arithmetic"
    with pytest.raises(DatasetError, match=r"data.val_data lists '.*my_dataset:dev': the dataset '.*my_dataset' has "
                                           r"no split 'dev'; its splits: train, test. Fix: .*my_dataset:train"):
        PromptDataset([f"{folder}:dev"], config_key="data.val_data")
    with pytest.raises(DatasetError, match=r"data.train_data lists '.*my_dataset:': nothing after the colon"):
        PromptDataset([f"{folder}:"], config_key="data.train_data")
    # identity by content, for a resume: the rows, not the folder's name
    before = train.digests()[0]
    write_jsonl(folder / "train.jsonl", skyrl_rows(2))
    after = PromptDataset([str(folder)]).digests()[0]
    assert before.file == after.file == str(folder) and before.sha256 != after.sha256


class FakeHub(http.server.BaseHTTPRequestHandler):
    """A hub on localhost: no such dataset (the hub's own 404), or an answer that never comes (until
    the test ends). ``paths`` records every request it got."""

    paths: list[str] = []
    release = threading.Event()

    def do_GET(self):
        FakeHub.paths.append(self.path)
        if self.path.startswith("/api/datasets/ridgeline-tests/missing"):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
        else:
            FakeHub.release.wait(HANG_GUARD_S)

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_hub():
    FakeHub.paths.clear()
    FakeHub.release.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    FakeHub.release.set()
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_names_fail_fast_with_one_message_naming_the_key(tmp_path, hf_cache, fake_hub, monkeypatch) -> None:
    import datasets
    import huggingface_hub

    real_sleep, sleeps, caller = time.sleep, [], threading.get_ident()

    def recorded_sleep(seconds):  # a retry backs off with time.sleep: none may happen (in this thread)
        if threading.get_ident() == caller:
            sleeps.append(seconds)
        real_sleep(seconds)

    def load(name):
        sleeps.clear()
        monkeypatch.setattr(time, "sleep", recorded_sleep)
        try:
            with pytest.raises(DatasetError) as info:
                PromptDataset([name], config_key="data.train_data")
        finally:
            monkeypatch.setattr(time, "sleep", real_sleep)
        return str(info.value), list(sleeps)

    # no hub at the endpoint (connection refused): no retries
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    message, sleeps = load("ridgeline-tests/no-such-dataset:test")
    assert message.startswith("data.train_data lists 'ridgeline-tests/no-such-dataset:test': neither a local")
    assert "the Hugging Face Hub could not be reached to load 'ridgeline-tests/no-such-dataset'" in message
    assert "HF_HUB_OFFLINE=1" in message and sleeps == []
    # a hub that never answers: the probe's time limit ends the one request (returning at all is
    # the event: the hub answers only when the test ends)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", fake_hub)
    monkeypatch.setattr(sources, "HUB_TIMEOUT_S", 0.5)
    message, sleeps = load("ridgeline-tests/silent")
    assert "could not be reached" in message and "Timeout" in message and sleeps == []
    assert [p for p in FakeHub.paths if "silent" in p] == ["/api/datasets/ridgeline-tests/silent"], FakeHub.paths
    # the hub says there is no such dataset
    message, _ = load("ridgeline-tests/missing")
    assert message.endswith("and the Hugging Face Hub has no dataset 'ridgeline-tests/missing'")
    # neither a path nor a hub id
    message, _ = load(str(tmp_path / "no" / "such" / "folder"))
    assert message.endswith("nor a Hugging Face dataset name")
    # offline: the local cache only, which does not have it
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    message, sleeps = load("ridgeline-tests/no-such-dataset")
    assert "datasets.load_dataset('ridgeline-tests/no-such-dataset') failed" in message
    assert "HF_HUB_OFFLINE is set" in message and sleeps == []


def test_train_command_names_an_unreachable_hub_dataset_without_a_traceback(tmp_path, hf_cache, monkeypatch,
                                                                           capsys) -> None:
    import huggingface_hub

    from ridgeline import cli

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    code = cli.main(["train", "+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                     "data.train_data=[openai/gsm8k:train]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("ridgeline: data.train_data lists 'openai/gsm8k:train': neither a local")


@pytest.fixture()
def ten_rows(tmp_path) -> PromptDataset:
    rows = [good_row(extra_info={"index": i}) for i in range(10)]
    return PromptDataset([write_jsonl(tmp_path / "ten.jsonl", rows)])


def ids(batches) -> list[list[int]]:
    return [[row.extra_info["index"] for row in batch] for batch in batches]


def test_batches_deterministic_per_seed_and_epoch(ten_rows) -> None:
    first = ids(ten_rows.batches(3, seed=1, epoch=0))
    assert first == ids(ten_rows.batches(3, seed=1, epoch=0))
    assert len(first) == 3 and all(len(b) == 3 for b in first)  # drop_last drops the 10th row
    assert ids(ten_rows.batches(3, seed=1, epoch=1)) != first
    assert ids(ten_rows.batches(3, seed=2, epoch=0)) != first
    # (seed, epoch) pairs that sum to the same value still differ.
    assert ids(ten_rows.batches(10, seed=0, epoch=1)) != ids(ten_rows.batches(10, seed=1, epoch=0))
    everything = ids(ten_rows.batches(3, seed=1, epoch=0, drop_last=False))
    assert everything[:3] == first and len(everything[3]) == 1
    assert sorted(sum(everything, [])) == list(range(10))
    assert ids(ten_rows.batches(3, seed=1, epoch=0, skip_batches=2)) == first[2:]
    assert ten_rows.num_batches(3) == 3 and ten_rows.num_batches(3, drop_last=False) == 4


def test_batches_argument_errors(ten_rows) -> None:
    with pytest.raises(ValueError, match="larger than the dataset"):
        ten_rows.batches(11, seed=0, epoch=0)
    with pytest.raises(ValueError, match="positive"):
        ten_rows.batches(0, seed=0, epoch=0)


# --- length filter --------------------------------------------------------------------------


def tiny_tokenizer():
    """A whitespace word-level tokenizer with a minimal chat template; built locally."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    # One token per message role marker, one per word, one for the generation prompt.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    return tokenizer


def test_drops_too_long_prompts(tmp_path, caplog) -> None:
    def row(words: int) -> dict:
        return good_row(prompt=[{"role": "user", "content": " ".join(["w"] * words)}], extra_info={"n": words})

    # Templated length = 1 (role) + words + 1 (generation prompt).
    path = write_jsonl(tmp_path / "mixed.jsonl", [row(3), row(8), row(6), row(20)])
    with caplog.at_level(logging.WARNING):
        dataset = PromptDataset([path], tokenizer=tiny_tokenizer(), max_prompt_tokens=8)
    assert [r.extra_info["n"] for r in dataset] == [3, 6]
    assert dataset.num_dropped_too_long == 2
    assert "dropped 2 of 4 prompts longer than trainer.max_prompt_length=8 tokens" in caplog.text

    unfiltered = PromptDataset([path], max_prompt_tokens=8)  # no tokenizer: no filtering
    assert len(unfiltered) == 4 and unfiltered.num_dropped_too_long == 0
    # the key the user sets, not the parameter's name (issue 29 #16)
    with pytest.raises(DatasetError, match=r"longer than trainer.max_prompt_length=2 tokens .* Fix: raise "
                                           r"trainer.max_prompt_length"):
        PromptDataset([path], tokenizer=tiny_tokenizer(), max_prompt_tokens=2)


# --- CLI ------------------------------------------------------------------------------------


def test_cli_prepare_arithmetic(tmp_path, capsys) -> None:
    out = tmp_path / "arith"
    assert cli_main(["prepare", "arithmetic", "--output", str(out), "--num-train", "30", "--num-val", "5",
                     "--ops", "+-", "--prompt-style", "hash", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "train.parquet") in printed and "30 rows" in printed and "5 rows" in printed
    assert 'after "####"' in read_table(out / "train.parquet")[0]["prompt"][0]["content"]

    assert cli_main(["prepare", "arithmetic", "--output", str(out), "--max-operand", "2"]) == 2
    assert "distinct problems" in capsys.readouterr().err


def test_cli_prepare_env_class(tmp_path, capsys) -> None:
    for env_class in ("multiply", "multiply_lenient"):
        out = tmp_path / env_class
        args = ["prepare", "multiply", "--output", str(out), "--num-train", "3", "--num-val", "1", "--num-digits", "2"]
        assert cli_main(args + (["--env-class", env_class] if env_class != "multiply" else [])) == 0
        assert {row["env_class"] for row in read_table(out / "train.parquet")} == {env_class}
    capsys.readouterr()


def test_cli_parser_wiring_and_gsm8k(tmp_path, capsys) -> None:
    import argparse

    if not GSM8K_DIR.is_dir():
        pytest.skip(f"shared GSM8K files not found at {GSM8K_DIR}")
    parser = argparse.ArgumentParser(prog="ridgeline")
    add_prepare_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["prepare", "gsm8k", "--output", str(tmp_path), "--input", str(GSM8K_DIR)])
    assert args.func is run_prepare
    assert args.func(args) == 0
    assert "7473 rows" in capsys.readouterr().out


def test_cli_module_entry_point(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ridgeline.data.cli", "prepare", "arithmetic", "--output", str(tmp_path),
         "--num-train", "10", "--num-val", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and (tmp_path / "validation.parquet").is_file()
