"""A real headless Chromium (Debian packages chromium + chromium-driver) driven with Selenium, in a
fresh profile: nothing logged in, nothing cached. Screenshots go to $CRUCIBLE_TEST_ARTIFACTS when
it is set (CI keeps that folder), else to the test's tmp_path."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS_ENV = "CRUCIBLE_TEST_ARTIFACTS"

requires_chromium = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="chromium and chromedriver not installed (apt-get install -y chromium chromium-driver)")


def chromium(profile: Path):
    """A headless Chromium with a new profile in `profile`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1680,1050"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def artifacts_dir(tmp_path: Path, test: str) -> Path:
    """Where a browser test keeps its screenshots: $CRUCIBLE_TEST_ARTIFACTS/<test>, else tmp_path."""
    root = os.environ.get(ARTIFACTS_ENV)
    out = Path(root) / test if root else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    print(f"{test}: screenshots in {out}")
    return out
