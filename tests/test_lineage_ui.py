"""The auditors' page in a real headless Chromium (Debian packages chromium + chromium-driver),
driven with Selenium against the service started as a real process on a free loopback port."""
import httpx
import pytest

from browser_helpers import artifacts_dir, chromium, requires_chromium
from infra.services.lineage.sample import DEFAULT_SOURCES, write_sample_log
from lineage_helpers import start_service
from tasks.core.net import free_port

LICENCES = {s["name"]: s["licence"] for s in DEFAULT_SOURCES}
RAW_FILES = sum(len(s["files"]) for s in DEFAULT_SOURCES)

pytestmark = requires_chromium

# true when the graph node `arguments[0]` (null: every node) lies within the graph's box as drawn
IN_VIEW = """
const box = document.querySelector('[data-testid="graph"]').getBoundingClientRect();
const nodes = [...document.querySelectorAll('#graph .node')].filter((n) => !arguments[0] || n.dataset.nodeId === arguments[0]);
return nodes.length > 0 && nodes.every((n) => { const r = n.getBoundingClientRect();
  return r.left >= box.left - 1 && r.right <= box.right + 1 && r.top >= box.top - 1 && r.bottom <= box.bottom + 1; });
"""


@pytest.fixture
def service(tmp_path):
    log, pipelines = write_sample_log(tmp_path / "work", pipelines=2)
    port = free_port()
    proc, base = start_service(tmp_path / "lineage.db", port, load=log)
    try:
        yield base, pipelines
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def browser(tmp_path):
    driver = chromium(tmp_path / "chromium-profile")
    try:
        yield driver
    finally:
        driver.quit()


def test_auditor_finds_model_sees_upstream_sources_and_licences(service, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base, (first, second) = service
    shots = artifacts_dir(tmp_path, "lineage_ui")
    wait = WebDriverWait(browser, 60)  # a loaded 2-core machine renders slowly
    testid = lambda t: f'[data-testid="{t}"]'  # noqa: E731
    browser.get(base + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    assert "events" in browser.find_element(By.CSS_SELECTOR, testid("stats")).text

    # search for the served model and open its newest version
    box = browser.find_element(By.CSS_SELECTOR, testid("search-input"))
    box.send_keys("crucible-tiny")
    browser.find_element(By.CSS_SELECTOR, testid("search-button")).click()
    model = second.model_version_node
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, testid("search-results")).get_attribute("data-query")
               == "crucible-tiny")
    result = wait.until(EC.element_to_be_clickable(
        (By.CSS_SELECTOR, f'{testid("search-result")}[data-node-id="{model}"]')))
    assert len(browser.find_elements(By.CSS_SELECTOR, testid("search-result"))) == 2
    Select(browser.find_element(By.CSS_SELECTOR, testid("direction"))).select_by_value("upstream")
    result.click()

    # the upstream graph reaches the raw files, each shown with its licence
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, testid("graph")).get_attribute("data-state") == "ready"
               and d.find_element(By.CSS_SELECTOR, testid("graph")).get_attribute("data-root") == model)
    sources = wait.until(lambda d: (lambda s: s if len(s) == RAW_FILES else False)(
        d.find_elements(By.CSS_SELECTOR, '[data-testid="graph-node"][data-kind="source"]')))
    assert {s.get_attribute("data-source"): s.get_attribute("data-licence") for s in sources} == LICENCES
    for s in sources:
        shown = s.find_element(By.CSS_SELECTOR, testid("node-licence")).text
        assert shown and s.get_attribute("data-licence").startswith(shown.rstrip("…"))
    nodes = browser.find_elements(By.CSS_SELECTOR, testid("graph-node"))
    ids = {n.get_attribute("data-node-id") for n in nodes}
    assert model in ids and "job:crucible:curate.ingest_sources" in ids
    assert browser.execute_script(IN_VIEW, model) and browser.execute_script(IN_VIEW, None)  # fitted on load
    assert browser.find_element(By.CSS_SELECTOR, f'{testid("graph-node")}[data-node-id="{model}"]') \
        .get_attribute("data-kind") == "model"

    # the detail panel describes the model version, with its hash and MLflow link
    wait.until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, testid("detail-name")), "models/crucible-tiny/2"))
    assert browser.find_element(By.CSS_SELECTOR, testid("detail-type")).text == "MODEL VERSION"
    assert len(browser.find_element(By.CSS_SELECTOR, testid("detail-version")).text) == 64
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, testid("detail-link"))]
    assert "http://127.0.0.1:5000/#/models/crucible-tiny/versions/2" in links

    # trace to sources
    browser.find_element(By.CSS_SELECTOR, testid("trace-button")).click()
    rows = wait.until(lambda d: (lambda r: r if len(r) == RAW_FILES else False)(
        d.find_elements(By.CSS_SELECTOR, testid("trace-source"))))
    assert {r.get_attribute("data-licence") for r in rows} == set(LICENCES.values())
    assert len(browser.find_elements(By.CSS_SELECTOR, testid("trace-licence"))) == len(LICENCES)
    browser.execute_script("arguments[0].scrollIntoView()", browser.find_element(By.CSS_SELECTOR, testid("trace-panel")))
    browser.save_screenshot(str(shots / "lineage_trace.png"))

    # the export buttons link to the provenance report in both formats
    md_href = browser.find_element(By.CSS_SELECTOR, testid("export-md")).get_attribute("href")
    json_href = browser.find_element(By.CSS_SELECTOR, testid("export-json")).get_attribute("href")
    md = httpx.get(md_href)
    assert md.status_code == 200 and "## Sources and licences" in md.text and "attachment" in md.headers[
        "content-disposition"]
    assert len(httpx.get(json_href).json()["sources"]) == RAW_FILES
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(shots / "lineage_model_upstream.png"))

    # clicking a raw source shows its licence and provenance
    raw = next(s for s in browser.find_elements(By.CSS_SELECTOR, '[data-testid="graph-node"][data-kind="source"]')
               if s.get_attribute("data-source") == "docs_crawl")
    raw.click()
    wait.until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, testid("detail-licence")),
                                                LICENCES["docs_crawl"]))
    assert browser.find_element(By.CSS_SELECTOR, testid("detail-type")).text == "RAW SOURCE"
    assert browser.find_element(By.CSS_SELECTOR, testid("detail-rows")).text == "150"
    browser.save_screenshot(str(shots / "lineage_raw_source.png"))

    # a small page of its downstream graph: "N more" groups stand for the rest of each fan-out,
    # a click on one brings its nodes in; the graph is fitted again
    raw_id = raw.get_attribute("data-node-id")
    Select(browser.find_element(By.CSS_SELECTOR, testid("direction"))).select_by_value("downstream")
    limit = browser.find_element(By.CSS_SELECTOR, testid("limit"))
    limit.clear()
    limit.send_keys("8")
    browser.find_element(By.CSS_SELECTOR, testid("focus-button")).click()
    graph = lambda d: d.find_element(By.CSS_SELECTOR, testid("graph"))  # noqa: E731
    wait.until(lambda d: graph(d).get_attribute("data-root") == raw_id and graph(d).get_attribute("data-state")
               == "ready" and graph(d).get_attribute("data-nodes") == "8")
    total = int(graph(browser).get_attribute("data-total"))
    groups = browser.find_elements(By.CSS_SELECTOR, testid("graph-group"))
    assert total > 8 and groups and all(int(g.get_attribute("data-count")) > 0 for g in groups)
    assert browser.execute_script(IN_VIEW, raw_id) and browser.execute_script(IN_VIEW, None)
    browser.save_screenshot(str(shots / "lineage_page_groups.png"))
    groups[0].click()
    wait.until(lambda d: graph(d).get_attribute("data-state") == "ready"
               and int(graph(d).get_attribute("data-nodes")) > 8)
    assert browser.execute_script(IN_VIEW, None)
    for name in ("lineage_model_upstream.png", "lineage_trace.png", "lineage_raw_source.png", "lineage_page_groups.png"):
        assert (shots / name).stat().st_size > 10_000
