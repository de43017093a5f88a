"""dsflash bench datasets: trtllm-bench's synthetic generators and JSON Lines format, and clear errors."""
import json

import pytest

from dsflash.serve.bench.dataset import (DatasetError, dataset_metadata, load_dataset, token_norm_dist,
                                         token_unif_dist, write_dataset)

VOCAB, EOS = 50, 7


def test_norm_dist_with_zero_stdev_gives_exact_lengths_and_no_eos():
    reqs = token_norm_dist(40, 33, 0, 9, 0, VOCAB, EOS, seed=3)
    assert [len(r.input_ids) for r in reqs] == [33] * 40
    assert [r.output_tokens for r in reqs] == [9] * 40
    ids = [t for r in reqs for t in r.input_ids]
    assert EOS not in ids and min(ids) >= 0 and max(ids) < VOCAB
    assert set(ids) == set(range(VOCAB)) - {EOS}       # 1320 draws cover the other 49 ids
    assert [r.task_id for r in reqs] == list(range(40))


def test_norm_dist_lengths_are_at_least_one_and_seeded():
    a = token_norm_dist(200, 3, 5, 2, 4, VOCAB, EOS, seed=11)
    b = token_norm_dist(200, 3, 5, 2, 4, VOCAB, EOS, seed=11)
    c = token_norm_dist(200, 3, 5, 2, 4, VOCAB, EOS, seed=12)
    assert [(r.input_ids, r.output_tokens) for r in a] == [(r.input_ids, r.output_tokens) for r in b]
    assert [r.input_ids for r in a] != [r.input_ids for r in c]
    assert min(len(r.input_ids) for r in a) == 1 and min(r.output_tokens for r in a) == 1   # clipped draws
    assert len({len(r.input_ids) for r in a}) > 5


def test_unif_dist_bounds_are_inclusive():
    reqs = token_unif_dist(300, 4, 6, 1, 2, VOCAB, None, seed=0)
    assert {len(r.input_ids) for r in reqs} == {4, 5, 6}
    assert {r.output_tokens for r in reqs} == {1, 2}


@pytest.mark.parametrize("call, msg", [
    (lambda: token_norm_dist(0, 8, 0, 8, 0, VOCAB, EOS), "--num-requests"),
    (lambda: token_norm_dist(4, 8, -1, 8, 0, VOCAB, EOS), "--input-stdev"),
    (lambda: token_unif_dist(4, 9, 8, 1, 1, VOCAB, EOS), "--input-min"),
])
def test_generator_arguments_are_checked(call, msg):
    with pytest.raises(DatasetError, match=msg):
        call()


def test_write_then_load_round_trips(tmp_path):
    reqs = token_unif_dist(5, 1, 9, 1, 4, VOCAB, EOS, seed=1)
    path = tmp_path / "d.jsonl"
    write_dataset(reqs, path)
    assert not (tmp_path / "d.jsonl.part").exists()
    back = load_dataset(path, VOCAB)
    assert [(r.task_id, r.input_ids, r.output_tokens) for r in back] == \
        [(r.task_id, r.input_ids, r.output_tokens) for r in reqs]
    meta = dataset_metadata(back, path)
    assert meta["num_requests"] == 5 and meta["max_isl"] == max(len(r.input_ids) for r in reqs)
    assert meta["avg_sequence_length"] == pytest.approx(meta["avg_isl"] + meta["avg_osl"])


def test_prompt_lines_are_tokenized_and_input_ids_win(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"task_id": "a", "prompt": "hi", "output_tokens": 2}) + "\n\n" +
                    json.dumps({"task_id": "b", "prompt": "ignored", "input_ids": [3, 4], "output_tokens": 1}) + "\n")
    reqs = load_dataset(path, VOCAB, encode=lambda s: [1] + [ord(c) % VOCAB for c in s])
    assert [(r.task_id, r.input_ids) for r in reqs] == [("a", [1, 104 % VOCAB, 105 % VOCAB]), ("b", [3, 4])]


@pytest.mark.parametrize("line, msg", [
    ("{not json", ":1: not a JSON object"),
    ("[1, 2]", ":1: expected a JSON object"),
    ('{"input_ids": [1], "output_tokens": 1}', ":1: task_id must be"),
    ('{"task_id": 0, "input_ids": [1]}', ":1: output_tokens must be an integer >= 1"),
    ('{"task_id": 0, "input_ids": [1], "output_tokens": 0}', ":1: output_tokens must be an integer >= 1"),
    ('{"task_id": 0, "input_ids": [1, 50], "output_tokens": 1}', r":1: input_ids must be .* in \[0, 50\)"),
    ('{"task_id": 0, "input_ids": [], "output_tokens": 1}', ":1: input_ids must be a non-empty list"),
    ('{"task_id": 0, "output_tokens": 1}', ":1: each line needs input_ids or prompt"),
    ('{"task_id": 0, "prompt": "x", "output_tokens": 1}', ":1: a prompt entry needs the engine's tokenizer"),
    ('{"task_id": 0, "input_ids": [1], "output_tokens": 1}\n{"task_id": 0, "input_ids": [2], "output_tokens": 1}',
     ":2: task_id 0 appears twice"),
    ("\n\n", "holds no requests"),
])
def test_malformed_lines_name_file_line_and_field(tmp_path, line, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=msg) as e:
        load_dataset(path, VOCAB)
    assert str(path) in str(e.value)


def test_missing_dataset_file(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_dataset(tmp_path / "nope.jsonl", VOCAB)
