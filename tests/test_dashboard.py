"""The dashboard in headless Chromium (Debian's, driven by Playwright): submit a job with a fault
plan through the page, watch its recovery appear with its MTTR, and use the nodes page."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from relaunch.diagnosis import ranks_text
from tests.runtime import UNCONDITIONAL, Server, kill_all, toy_job, wait_gone

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    assert CHROMIUM.exists(), (
        f"the dashboard test needs Debian's Chromium at {CHROMIUM}: `make test` installs it "
        "(apt-get install chromium)"
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=FLAGS
        )
        context = browser.new_context(viewport={"width": 1280, "height": 1100})
        yield context.new_page()
        context.close()
        browser.close()


def test_submit_on_the_page_and_watch_the_recovery(page: Page, tmp_path: Path) -> None:
    server = Server(tmp_path).start()
    try:
        page.goto(server.url + "/")
        page.fill("#token", server.token)
        page.dispatch_event("#token", "change")
        job = toy_job(
            {**UNCONDITIONAL, "fault-tolerance/hang-retry": "true"},
            steps=90,
            args="--step-seconds 0.05",
        )
        job["metadata"]["name"] = "dashboard-demo"
        job["fault_plan"] = [
            {"kind": "process-exit", "at_step": 30, "pod": 1, "exit_code": 7},
            {"kind": "hang", "at_step": 60, "pod": 0, "rank": 1},
        ]
        page.fill("#job-json", json.dumps(job, indent=2))
        page.click("#submit")

        page.wait_for_url(re.compile(r"#/jobs/default/1$"))
        expect(page.locator("#job-phase")).to_have_text("Running", timeout=30_000)
        row = page.locator("#records tbody tr").first
        expect(row).to_contain_text("process-exit (exit 7)", timeout=60_000)
        expect(row).to_contain_text("job-reschedule")
        expect(row.locator(".mttr")).to_have_text(re.compile(r"^\d+\.\d\d$"), timeout=60_000)
        expect(row.locator(".outcome")).to_have_text("succeeded")
        expect(page.locator("#job-phase")).to_have_text("Succeeded", timeout=60_000)
        expect(page.locator("#job-step")).to_have_text("90")
        expect(page.locator("#progress-chart polyline")).to_have_count(1)
        expect(page.locator("#progress-chart text.resume").first).to_contain_text("MTTR")
        expect(page.locator("#pods tbody tr")).to_have_count(2)
        expect(page.locator("#diagnosis-1")).to_contain_text("root cause: process-exit (exit 7)")
        expect(page.locator("#diagnosis-1")).to_contain_text("last output: step")
        hang = page.locator("#diagnosis-2")
        expect(hang).to_contain_text("root cause: hang rank 1", timeout=60_000)
        expect(hang).to_contain_text("rank 1 (stopped) — culprit")
        # the culprit's own stack (rank 0 runs on alone and may have ended by the capture)
        culprit = hang.locator("div", has_text="rank 1 (stopped) — culprit")
        expect(culprit.locator("xpath=following-sibling::pre[1]")).to_contain_text("train_toy.py")
        # a group of alike stacks is headed by its ranks as runs, as `describe` writes them
        for ranks in ([4], [2, 0], [0, 1, 3], [0, 1, 2, 3, 5, 7, 8, 9, 10], list(range(4095))):
            assert page.evaluate(f"ranksText({ranks})") == ranks_text(ranks)
        expect(page.locator("#goodput .goodput-legend")).to_contain_text("ETTR")
        expect(page.locator("#goodput .goodput-legend")).to_contain_text("recovery")
        assert page.locator("#goodput .goodput-part").count() >= 2
        shot = tmp_path / "job-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        target = os.environ.get("RELAUNCH_SCREENSHOT_DIR")
        if target:
            shutil.copy(shot, Path(target) / "dashboard-job.png")

        page.click("#nav-nodes")
        nodes = page.locator("#nodes tbody tr")
        expect(nodes).to_have_count(4)
        page.click("#cordon-node-3")
        expect(nodes.nth(3)).to_contain_text("Isolated")
        page.click("#release-node-3")
        expect(nodes.nth(3)).to_contain_text("Ready")

        page.fill("#token", "wrong")
        page.dispatch_event("#token", "change")
        page.click("#cordon-node-3")
        expect(page.locator("#error")).to_contain_text("HTTP 401")
    finally:
        server.stop()
        left = wait_gone(server.state, timeout=15)
        kill_all(server.state)
    assert not left
