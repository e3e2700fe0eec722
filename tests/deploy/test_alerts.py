"""deploy/prometheus/kvtier-alerts.yaml: promtool accepts the rules and passes their unit tests, and every alert
has a unit-test case that fires it and one that must not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = DEPLOY / "kvtier-alerts.yaml"
UNIT_TESTS = DEPLOY / "kvtier-alerts.test.yaml"
ALERTS = ("KVTierTierOutage", "KVTierCorruptObjects", "KVTierDroppedWrites", "KVTierHitRatioCollapsed",
          "KVTierEventGapsNotRecovered", "KVTierEngineDown", "KVTierRouterAddEngines")
FLEET_WIDE = ("KVTierRouterAddEngines",)  # about the fleet as a whole: no one server to name


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian package `prometheus`): the alerting rules are not checked")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=DEPLOY)


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _rule_tests() -> list[dict[str, Any]]:
    return [case for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests() -> None:
    result = _promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_group_holds_the_alerts() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert [g["name"] for g in groups] == ["kvtier"]
    assert sorted(rule["alert"] for rule in _rules()) == sorted(ALERTS)


@pytest.mark.parametrize("alert", ALERTS)
def test_alert_has_severity_and_annotations(alert: str) -> None:
    rule = next(rule for rule in _rules() if rule["alert"] == alert)
    assert rule["labels"]["severity"] in ("warning", "critical")
    assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip()
    # An alert says where: the server (or the router's engine name) it is about, or that it is the fleet's.
    text = rule["annotations"]["summary"] + rule["annotations"]["description"]
    assert "$labels.server" in text or "$labels.engine" in text or (alert in FLEET_WIDE and "fleet" in text)


def test_unit_tests_load_the_rules() -> None:
    assert yaml.safe_load(UNIT_TESTS.read_text())["rule_files"] == [RULES.name]


@pytest.mark.parametrize("alert", ALERTS)
def test_alert_has_firing_and_quiet_cases(alert: str) -> None:
    cases = [case for case in _rule_tests() if case["alertname"] == alert]
    assert any(case.get("exp_alerts") for case in cases), f"no unit-test case fires {alert}"
    assert any(not case.get("exp_alerts") for case in cases), f"no unit-test case where {alert} must not fire"
