"""The study configuration section: the settings table, the shape check it drives, init's pure merge."""
from __future__ import annotations

import pytest

from conftest import ab


def test_every_key_in_the_table_is_a_study_key_and_every_launch_default_has_a_setting():
    keys = [s.key for s in ab.STUDY_SETTINGS]
    assert len(keys) == len(set(keys))
    assert ab.STUDY_KEYS == frozenset(keys)
    # Every launch default except `slurm` (an object with its own check) is a setting with a flag.
    for key in ab.DEFAULT_LAUNCH:
        setting = next(s for s in ab.STUDY_SETTINGS if s.key == key)
        assert setting.default == ab.DEFAULT_LAUNCH[key]
        assert setting.flag is not None or key == "slurm", key
    assert set(ab.BUDGET_SETTINGS) == set(ab.DEFAULT_BUDGET)


def test_init_has_a_flag_with_help_for_every_setting_that_has_one():
    parser = ab.build_parser(ab.COMMANDS["init"])
    flags = {a.dest: a for a in parser._actions}
    for s in ab.STUDY_SETTINGS:
        if s.flag is not None:
            assert flags[s.key].help == s.help and s.help, s.key
    for key, (_, text) in ab.BUDGET_SETTINGS.items():
        assert flags[key].help.endswith(text)


@pytest.mark.parametrize("existing, settings, budget, expected_changed, expected", [
    # A new study: the on_create defaults and the whole default budget.
    (None, {}, {}, [], {"model": ab.DEFAULT_LAUNCH["model"], "parallel": ab.DEFAULT_LAUNCH["parallel"],
                        "max_minutes": ab.DEFAULT_LAUNCH["max_minutes"], "budget": ab.DEFAULT_BUDGET}),
    # A value given over a new study wins over its default and is reported as changed.
    (None, {"parallel": 2}, {"wall_s": 60.0}, ["parallel", "budget.wall_s"], {"parallel": 2}),
    # An existing study keeps what is not given; the same value again is no change.
    ({"model": "claude-sonnet-4", "budget": {"usd_per_run": 1.0}}, {"model": "claude-sonnet-4", "seed": 7},
     {"usd_per_run": 1.0}, ["seed"], {"model": "claude-sonnet-4", "seed": 7, "budget": {"usd_per_run": 1.0}}),
    # No defaults are written into an existing study.
    ({"tasks": "t"}, {}, {}, [], {"tasks": "t", "budget": {}}),
])
def test_merge_table(existing, settings, budget, expected_changed, expected):
    cfg, changed = ab.merge_study_config(existing, settings, budget)
    assert changed == expected_changed
    for key, val in expected.items():
        assert cfg[key] == val, key
    if existing is not None:
        assert "effort" not in cfg or "effort" in existing


def test_merge_keeps_the_users_key_order_so_the_first_arm_stays_the_baseline():
    existing = {"arms": {"Z": {}, "A": {}}, "tasks": "t"}
    cfg, _ = ab.merge_study_config(existing, {"seed": 1}, {})
    assert list(cfg) == ["arms", "tasks", "seed", "budget"] and list(cfg["arms"]) == ["Z", "A"]


@pytest.mark.parametrize("items, before, after, changed", [
    (["A=1"], {}, {"A": "1"}, ["env"]),
    (["A="], {"A": "1", "B": "2"}, {"B": "2"}, ["env"]),
    (["A=1"], {"A": "1"}, {"A": "1"}, []),
])
def test_merge_env_items(items, before, after, changed):
    cfg, got = ab.merge_study_config({"env": before}, {}, {}, env_items=items)
    assert cfg.get("env", {}) == after and got == changed


def test_merge_refuses_a_bad_env_item_and_an_object_key_that_is_not_an_object():
    with pytest.raises(ab.AgentbenchError) as e:
        ab.merge_study_config({}, {}, {}, env_items=["1BAD=x"])
    assert e.value.payload["value"] == "1BAD=x"
    with pytest.raises(ab.AgentbenchError) as e:
        ab.merge_study_config({"budget": 5}, {}, {})
    assert e.value.payload["key"] == "budget"


@pytest.mark.parametrize("cfg, key", [
    ({"tasks": 3}, "tasks"), ({"repeats": 0}, "repeats"), ({"repeats": True}, "repeats"),
    ({"seed": 1.5}, "seed"), ({"parallel": 0}, "parallel"), ({"max_minutes": 0}, "max_minutes"),
    ({"stall_after_s": -1}, "stall_after_s"), ({"budget": []}, "budget"), ({"arms": "A"}, "arms"),
    ({"env": {"A": 1}}, "env"), ({"snapshot_seconds": [0]}, "snapshot_seconds"),
])
def test_the_shape_check_names_the_key(cfg, key):
    with pytest.raises(ab.AgentbenchError) as e:
        ab.check_study_shape(cfg)
    assert e.value.payload["key"] == key


def test_a_shape_that_passes():
    ab.check_study_shape({"tasks": "tasks", "arms": {"A": {"gate_cycles": 2, "review": True}}, "repeats": 2,
                          "budget": {"usd_per_run": 1.0}, "executor": "local", "_comment": "free"})


HUGE = 10 ** 400   # JSON allows an integer this long; it is no float


@pytest.mark.parametrize("cfg, key", [
    ({"max_minutes": HUGE}, "max_minutes"), ({"stall_after_s": HUGE}, "stall_after_s"),
    ({"snapshot_seconds": [HUGE]}, "snapshot_seconds"),
])
def test_an_integer_too_large_for_a_float_is_refused_by_name_not_an_internal_error(cfg, key):
    with pytest.raises(ab.AgentbenchError) as e:
        ab.check_study_shape(cfg)
    assert e.value.code == "bad_setting_type" and e.value.payload["key"] == key


@pytest.mark.parametrize("cfg", [{"budget": {"usd_per_run": HUGE}}, {"prices": {"m": [HUGE, 1, 1, 1, 1]}}])
def test_a_huge_integer_in_the_budget_or_prices_is_refused(cfg):
    with pytest.raises(ab.AgentbenchError):
        ab.check_study_shape(cfg)


def test_a_study_file_with_a_huge_integer_answers_exit_2(tmp_path):
    from conftest import run_main
    root = tmp_path / "s"
    assert run_main(["init", "--study", str(root)])[0] == 0
    text = (root / "study.json").read_text().replace('"max_minutes": 60', '"max_minutes": 1' + "0" * 400)
    assert '"max_minutes": 1000' in text
    (root / "study.json").write_text(text)
    code, out = run_main(["report", "--study", str(root)])
    assert code == 2 and out["code"] == "bad_setting_type" and out["key"] == "max_minutes"
