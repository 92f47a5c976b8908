"""The device profile and the block-size choice that reads it."""

import json

import pytest
from conftest import tiny_drafter

from dominospec.errors import DominoError
from dominospec.tune import profile as cost


def profile_table(verify_ms, draft_ms=None):
    table = {"verify": {"256": {"k": list(range(1, len(verify_ms) + 1)), "seconds": [v / 1e3 for v in verify_ms]}}}
    if draft_ms:
        table["draft"] = {"b": list(range(1, len(draft_ms) + 1)), "seconds": [d / 1e3 for d in draft_ms]}
    return table


def test_expected_tokens_is_one_plus_the_sum_of_survival_products():
    assert cost.expected_tokens([0.5, 0.5, 1.0], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert cost.expected_tokens([0.9], 0) == 1.0


def test_best_block_size_maximises_expected_tokens_per_second():
    # verify costs grow slowly; a drafter accepted 90% of the time should draft the most it can
    table = profile_table([100, 105, 110, 115, 120], [5, 6, 7, 8])
    b, rates = cost.best_block_size(table, [0.9] * 4, max_b=4)
    assert b == 4 and rates[4] == max(rates.values())
    # the same device with a drafter that is rarely right: plain decoding (b = 0) wins
    b, rates = cost.best_block_size(table, [0.05] * 4, max_b=4)
    assert b == 0 and rates[0] == pytest.approx(1 / 0.1)


def test_best_block_size_sees_a_cost_jump():
    # a kernel switch makes 4 new tokens as dear as 2 steps: stop before it
    table = profile_table([100, 110, 115, 200, 205])
    b, _ = cost.best_block_size(table, [0.6, 0.6, 0.6, 0.6], max_b=4)
    assert b == 2


def test_profile_and_auto_block_size_round_trip(llama_target, tmp_path, monkeypatch):
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path / "cache"))
    drafter = tiny_drafter(llama_target, block_size=4)
    drafter.directory = tmp_path / "drafter"
    drafter.directory.mkdir()
    b, note = cost.auto_block_size(llama_target, drafter)
    assert b == 4 and "acceptance.json" in note  # nothing measured yet: the drafter's own
    (drafter.directory / "acceptance.json").write_text(json.dumps({"conditional": [0.9, 0.8, 0.7, 0.6]}))
    table = cost.profile_device(llama_target, drafter, contexts=(16, 600), max_k=5, repeats=1, progress=False)
    assert list(table["verify"]) == ["16"]  # 600 + 5 does not fit the 512-position target
    assert table["draft"]["b"] == [1, 2, 3, 4] and table["fingerprint"]["backend"] == "hf"
    path = cost.save_profile(table)
    assert path.parent == tmp_path / "cache" / "profiles" and cost.load_profile(llama_target) == table
    b, note = cost.auto_block_size(llama_target, drafter)
    assert 0 <= b <= 4 and "chose" in note


def test_a_profile_belongs_to_the_kernel_build_it_was_timed_with(native_targets, llama_target, tmp_path, monkeypatch):
    """Protects: a profile stored before the small-row kernel's source changed (another build key), or
    with the kernel switched off, is not read for today's kernel: verify and decode cost otherwise. (A target
    on transformers' forward does not run the kernel: its profile says "off".)"""
    from dominospec.targets import kernels

    hf_target, llama_target = llama_target, native_targets["llama"]
    if kernels.load_kernels() is None:
        pytest.skip("the small-row kernel does not build here (no compiler)")
    assert cost.device_fingerprint(hf_target)["kernel"] == "off"

    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    cost.ensure_profile(llama_target, max_k=2, report=lambda _: None, contexts=(16,))
    assert cost.load_profile(llama_target) is not None
    monkeypatch.setattr(kernels, "build_key", lambda: "another-source")
    assert cost.load_profile(llama_target) is None
    monkeypatch.undo()
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    assert cost.load_profile(llama_target) is not None
    monkeypatch.setenv(kernels.ENV_SWITCH, "off")
    assert cost.device_fingerprint(llama_target)["kernel"] == "off" and cost.load_profile(llama_target) is None


def test_a_missing_profile_is_measured_once_then_reused(llama_target, tmp_path, monkeypatch):
    """Protects: first use measures a short profile (saying so in one line) and stores it; the
    second use reads the stored one without measuring."""
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    said = []
    table = cost.ensure_profile(llama_target, max_k=3, report=said.append, contexts=(16,))
    assert len(said) == 1 and "quick" in said[0] and table["quick"] is True
    assert table["verify"]["16"]["k"] == [1, 2, 3] and "draft" not in table
    path = cost.profile_path(cost.device_fingerprint(llama_target))
    assert path.exists() and cost.load_profile(llama_target) == table
    said.clear()
    assert cost.ensure_profile(llama_target, max_k=3, report=said.append, contexts=(16,)) == table and not said
    drafter = tiny_drafter(llama_target, block_size=2)  # a drafter's cost is added to the stored table
    with_draft = cost.ensure_profile(llama_target, drafter, max_k=3, report=said.append, contexts=(16,))
    assert with_draft["draft"]["b"] == [1, 2] and cost.load_profile(llama_target)["draft"]["b"] == [1, 2]
    assert len(with_draft["draft"]["seconds_sampled"]) == 2 and with_draft["draft"]["method"] == cost.DRAFT_METHOD
    # a draft cost timed the old way (the backbone and rollout alone, no cache update) is measured again
    old = {**with_draft, "draft": {k: v for k, v in with_draft["draft"].items() if k != "method"}}
    cost.save_profile(old)
    again = cost.ensure_profile(llama_target, drafter, max_k=3, report=said.append, contexts=(16,))
    assert again["draft"]["method"] == cost.DRAFT_METHOD


def test_a_profile_too_short_for_the_block_is_measured_again(llama_target, tmp_path, monkeypatch):
    """Protects: a stored profile timed for fewer new tokens than this run verifies (one measured for a
    smaller block) is measured again to the run's k, saying so, instead of capping every cycle's drafts."""
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    said = []
    short = cost.ensure_profile(llama_target, max_k=3, report=said.append, contexts=(16,))
    assert short["verify"]["16"]["k"] == [1, 2, 3]
    said.clear()
    longer = cost.ensure_profile(llama_target, max_k=6, report=said.append, contexts=(16,))
    assert len(said) == 1 and "reaches 3 new tokens" in said[0] and "up to 6" in said[0]
    assert longer["verify"]["16"]["k"] == [1, 2, 3, 4, 5, 6] and cost.load_profile(llama_target) == longer
    said.clear()
    assert cost.ensure_profile(llama_target, max_k=4, report=said.append, contexts=(16,)) == longer and not said


def test_the_suite_keeps_its_profiles_out_of_the_users_cache(private_profile_cache):
    """Protects: tests time the target while the machine is loaded; those tables must never become the
    user's stored profile (the conftest points the cache at a session directory, sharing only models,
    kernels and tokenizers with the user's)."""
    from dominospec.io import cache_dir

    assert cache_dir() == private_profile_cache and (cache_dir() / "models").is_symlink()
    assert cost.profile_path({}).parent == cache_dir() / "profiles"
    assert not (cache_dir() / "profiles").is_symlink()


def test_sampling_reads_the_sampled_draft_cost(llama_target):
    from dominospec.decode.schedule import CostTable

    drafter = tiny_drafter(llama_target, block_size=2)
    table = {
        "verify": {"256": {"k": [1, 2], "seconds": [0.01, 0.012]}},
        "draft": {"drafter": cost.profile_drafter_label(drafter), "b": [1, 2], "seconds": [0.002, 0.003]},
    }

    def step_seconds(costs, sampled):  # one row, anchor + 1 draft, drafting included
        return costs.step_seconds(1, 2, sampled=sampled)

    no_column = CostTable.from_profile(table, drafter, 2)
    assert step_seconds(no_column, True) == pytest.approx(0.015)  # no sampled column: greedy's
    table["draft"]["seconds_sampled"] = [0.004, 0.005]
    costs = CostTable.from_profile(table, drafter, 2)
    assert step_seconds(costs, True) == pytest.approx(0.017) and step_seconds(costs, False) == pytest.approx(0.015)


GOOD = {"fingerprint": {}, "verify": {"256": {"k": [1, 2], "seconds": [0.01, 0.012]}}}


@pytest.mark.parametrize(
    "damage, why",
    [
        ("", "unreadable or truncated"),
        (json.dumps(GOOD)[:-9], "unreadable or truncated"),
        ("directory", "is a directory"),
        (json.dumps({"fingerprint": {}}), "no 'verify' table"),
        (json.dumps({**GOOD, "verify": {"256": {"k": [1, 2]}}}), "size and seconds lists"),
        (json.dumps({**GOOD, "verify": {"256": {"k": [1, 2], "seconds": [0.01, 0.0]}}}), "0.0 seconds"),
        (json.dumps({**GOOD, "verify": {"256": {"k": [1, 2], "seconds": [0.01, float("nan")]}}}), "nan"),
        (json.dumps({**GOOD, "draft": {"b": [1], "seconds": [-1]}}), "-1 seconds"),
    ],
)
def test_a_damaged_profile_is_refused_naming_the_file_and_remade(damage, why, llama_target, tmp_path, monkeypatch):
    """Protects: a truncated, empty, directory, keyless or zero/NaN-timed profile is never used: reading
    it raises a DominoError that names the file and the fault, and first use measures a new one."""
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    path = cost.profile_path(cost.device_fingerprint(llama_target))
    path.parent.mkdir(parents=True)
    if damage == "directory":
        (path / "inner").mkdir(parents=True)
    else:
        path.write_text(damage)
    with pytest.raises(DominoError, match=why) as err:
        cost.load_profile(llama_target)
    assert str(path) in str(err.value)
    said = []
    table = cost.ensure_profile(llama_target, max_k=2, report=said.append, contexts=(16,))
    assert str(path) in said[0] and "measuring it again" in said[0] and "quick" in said[1]
    assert path.is_file() and cost.load_profile(llama_target) == table


def test_an_intact_profile_passes_the_check(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(GOOD))  # control: the checks above refuse faults, not good tables
    assert cost.read_profile(path) == GOOD
