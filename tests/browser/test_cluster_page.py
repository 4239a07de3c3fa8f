"""The cluster page for thousands of GPUs (issue 47, item 4) in a real browser, on a modest
cluster (40 nodes x 8 GPUs, 12 jobs: tests/support/cluster_page.py, a driver process with its
own database and daphne): the summary's counts, the node list narrowed by state, job and name,
a job's GPUs highlighted on the map (what the map draws, read from the page's model), a cell
named on hover, a node lost live (counts, cell and row change without a reload), and no
horizontal overflow at 390 px."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import cluster_page as cp
from tests.support.reading import OVERFLOW
from tests.support.stack import ROOT, empty_redis_db

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(300)]

NODES, GPUS, JOBS = 40, 8, 12
REDIS_DB = 11  # the driver's own channel layer (the shared stack's is 3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The driver: serving, with its cluster described (url, password, nodes, jobs)."""
    env = dict(os.environ, REDIS_URL=empty_redis_db(os.environ["REDIS_URL"], REDIS_DB))
    env.pop("DATABASE_URL", None)
    var_dir = tmp_path_factory.mktemp("cluster-page")
    driver = subprocess.Popen(
        [sys.executable, "-m", "tests.support.cluster_page", "--var-dir", str(var_dir), "--nodes", str(NODES),
         "--gpus-per-node", str(GPUS), "--jobs", str(JOBS)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        assert line, "the cluster page driver exited before serving"
        info = json.loads(line)

        def command(text: str) -> int:
            driver.stdin.write(text + "\n")
            driver.stdin.flush()
            answer = driver.stdout.readline().split()
            assert answer[0] == "ok", answer
            return int(answer[1])

        info["command"] = command
        yield info
    finally:
        if driver.poll() is None:
            driver.stdin.write("quit\n")
            driver.stdin.flush()
            try:
                driver.wait(timeout=30)
            except subprocess.TimeoutExpired:
                driver.kill()


def _count(page, name: str) -> int:
    return int(page.locator(f"[data-count={name}]").inner_text().replace(",", ""))


def _listed(page) -> list[str]:
    return page.eval_on_selector_all("[data-node]", "rows => rows.map((r) => r.dataset.node)")



def _live_page(cluster, browser):
    """A signed-in page on the cluster page, live; and the list its page errors go to."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    cp.sign_in(page, cluster["url"], cluster["password"])
    page.wait_for_selector("#connection[data-state=live]")
    return page, errors

def test_summary_filters_highlight_live_loss_and_a_phone(cluster, browser) -> None:
    jobs = {name: [f"{node}/{index}" for node, index in pairs] for name, pairs in cluster["jobs"].items()}
    held = sum(len(keys) for keys in jobs.values())
    page, errors = _live_page(cluster, browser)
    page.evaluate("window.__sameDocument = true")

    # Summary first: nodes, GPUs and jobs by state.
    assert (_count(page, "node-total"), _count(page, "node-healthy"), _count(page, "node-lost")) == (NODES, NODES, 0)
    assert (_count(page, "gpu-total"), _count(page, "gpu-free"), _count(page, "gpu-allocated"),
            _count(page, "gpu-lost")) == (NODES * GPUS, NODES * GPUS - held, held, 0)
    placed = sum(1 for keys in jobs.values() if keys)
    assert (_count(page, "job-total"), _count(page, "job-running"), _count(page, "job-pending")) == (
        JOBS, placed, JOBS - placed)
    assert page.locator("#gpu-map").get_attribute("data-cells") == str(NODES * GPUS)
    assert _listed(page) == cluster["nodes"]  # 40 nodes: one page, by name

    # Filtering narrows the node list: by name, by job, by state.
    page.get_by_label("Name", exact=True).fill("node-001")
    page.wait_for_function("document.querySelectorAll('[data-node]').length === 10")
    assert _listed(page) == [f"node-00{n}" for n in range(10, 20)]
    page.get_by_label("Name", exact=True).fill("")
    page.get_by_label("Job", exact=True).select_option("job-003")
    nodes_of_job = sorted({key.split("/")[0] for key in jobs["job-003"]})
    page.wait_for_function(f"document.querySelectorAll('[data-node]').length === {len(nodes_of_job)}")
    assert _listed(page) == nodes_of_job

    # Selecting a job highlights exactly its GPUs: on the map (what it draws, from the page's
    # model) and on the listed nodes' chips.
    assert page.evaluate("window.dynaplane.highlighted()") == sorted(jobs["job-003"])
    drawn = page.evaluate("window.dynaplane.model.slots.map((g) => `${g.node}/${g.index}`)"
                          ".filter((key) => window.dynaplane.cell(key).highlighted)")
    assert sorted(drawn) == sorted(jobs["job-003"])
    chips = page.eval_on_selector_all("[data-gpu][data-highlight=true]", "cs => cs.map((c) => c.dataset.gpu)")
    assert sorted(chips) == sorted(jobs["job-003"])
    # ... and so does its GPU count in the jobs table.
    page.locator("tr[data-job=job-005] [data-select-job]").click()
    assert page.get_by_label("Job", exact=True).input_value() == "job-005"
    assert page.evaluate("window.dynaplane.highlighted()") == sorted(jobs["job-005"])
    page.get_by_label("Job", exact=True).select_option("")
    page.wait_for_function(f"document.querySelectorAll('[data-node]').length === {NODES}")
    assert page.evaluate("window.dynaplane.highlighted()") == []

    # Hovering a cell names it.
    key = jobs["job-001"][2]
    box = page.evaluate(f"window.dynaplane.cellBox('{key}')")
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    tip = page.locator("#gpu-tip")
    tip.wait_for(state="visible")
    node, index = key.split("/")
    assert tip.inner_text() == f"{node} GPU {index}: allocated (job job-001)"

    # Live: node-0002 (no job on it) stops beating and is marked lost; the page follows.
    page.get_by_label("State", exact=True).select_option("lost")
    page.wait_for_function("document.querySelectorAll('[data-node]').length === 0")
    seq = cluster["command"]("lose node-0002")
    page.wait_for_function(f"Number(document.body.dataset.seq) === {seq}")
    assert (_count(page, "node-healthy"), _count(page, "node-lost")) == (NODES - 1, 1)
    assert (_count(page, "gpu-free"), _count(page, "gpu-lost")) == (NODES * GPUS - held - GPUS, GPUS)
    assert [page.evaluate(f"window.dynaplane.cell('node-0002/{i}').state") for i in range(GPUS)] == ["lost"] * GPUS
    assert page.evaluate("window.dynaplane.cell('node-0001/0').state") == "free"
    assert _listed(page) == ["node-0002"]  # the lost filter now lists it
    assert page.locator("[data-node=node-0002]").get_attribute("data-state") == "lost"
    assert page.locator("[data-gpu^='node-0002/'][data-state=lost]").count() == GPUS
    assert page.locator("#summary").inner_text().startswith(f"{NODES - 1}/{NODES} nodes healthy")
    assert f"{GPUS} lost" in page.locator("#summary").inner_text()
    page.get_by_label("State", exact=True).select_option("")
    page.wait_for_selector("[data-group=lost] + [data-node=node-0002]")  # lost nodes first
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded"

    # A phone: the summary reads, the map fits the width, no horizontal overflow.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_function("document.getElementById('gpu-map').getBoundingClientRect().width <= 390")
    page.wait_for_timeout(200)
    assert page.evaluate(OVERFLOW) <= 0
    assert page.locator("[data-count=gpu-lost]").is_visible() and _count(page, "gpu-lost") == GPUS
    assert page.evaluate("window.dynaplane.cell('node-0002/0').state") == "lost"
    assert errors == [], errors


def test_the_filter_is_in_the_address_and_a_link_opens_the_page_so(cluster, browser) -> None:
    """A shared link opens the cluster page filtered and outlined as its sender had it; changing
    the filter rewrites the address (no reload); what the page does not know is left out."""
    jobs = {name: [f"{node}/{index}" for node, index in pairs] for name, pairs in cluster["jobs"].items()}
    page, errors = _live_page(cluster, browser)
    nodes_of_job = sorted({key.split("/")[0] for key in jobs["job-003"]})
    page.goto(cluster["url"] + f"?state=healthy&job=job-003&node={nodes_of_job[0]}")
    page.wait_for_selector("#connection[data-state=live]")
    assert page.get_by_label("State", exact=True).input_value() == "healthy"
    assert page.get_by_label("Job", exact=True).input_value() == "job-003"
    assert page.get_by_label("Name", exact=True).input_value() == nodes_of_job[0]
    assert _listed(page) == [nodes_of_job[0]]
    assert page.evaluate("window.dynaplane.highlighted()") == sorted(jobs["job-003"])
    page.evaluate("window.__sameDocument = true")
    page.get_by_label("Name", exact=True).fill("")
    page.wait_for_function(f"document.querySelectorAll('[data-node]').length === {len(nodes_of_job)}")
    assert page.evaluate("location.search") == "?state=healthy&job=job-003"
    page.locator("tr[data-job=job-005] [data-select-job]").click()
    assert page.evaluate("location.search") == "?state=healthy&job=job-005"
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded"
    page.goto(cluster["url"] + "?state=bogus&job=no-such-job&node=node-000")
    page.wait_for_selector("#connection[data-state=live]")
    assert page.get_by_label("State", exact=True).input_value() == ""
    assert page.get_by_label("Job", exact=True).input_value() == ""
    assert page.evaluate("location.search") == "?node=node-000"
    # (node-0002, lost in the test above, first: grouped by state)
    assert sorted(_listed(page)) == [n for n in cluster["nodes"] if "node-000" in n]
    assert errors == [], errors
