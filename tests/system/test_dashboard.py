"""The status page in a real headless browser (Debian's chromium, driven by Playwright) on a real deployment.

A disaggregated 1 prompt + 2 token stage deployment with a spare, API keys on, one of the admin role, and
the controller holding the admin signing key (``controller.admin_signing_key_file``). The browser opens
``/dashboard`` with the admin key (HTTP Basic auth, as a person's browser would ask for it), sees the
topology, and kills token stage 1's worker with the page's Kill button while a request streams: the page
shows the spare take the stage at a newer epoch and the repair end, and the request completes exactly (its
text equals the in-process engine's, as in the failure tests).
"""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest
from openai import OpenAI
from pydantic import SecretStr

from dejavu_common.private import write_private
from dejavu_controller.api.auth import key_id

from .cluster import cluster_settings, logs, running
from .reference import Reference

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

API_KEY = "sk-dashboard-user"
ADMIN_KEY = "sk-dashboard-admin"
PROMPT = "Once upon a time"
# Long enough that the request is still decoding when the kill lands (workers read admin commands at every
# heartbeat) and through the repair that follows; EOS ignored so that its length does not depend on the text.
MAX_TOKENS = 256
TIMEOUT_MS = 90_000


def _chromium() -> str:
    """Debian's chromium, or skip: the browser test needs it and Playwright for Python (``make test`` installs
    both: scripts/ensure-system-packages.sh test, requirements/dev.txt)."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed (requirements/dev.txt)")
    return executable


class Stream:
    """One streaming completion in a thread, through the official client."""

    def __init__(self, api_url: str, model: str) -> None:
        self.client = OpenAI(base_url=api_url + "/v1", api_key=API_KEY, timeout=240, max_retries=0)
        self.model = model
        self.parts: list[str] = []
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                with self.cond:
                    if chunk.choices:
                        self.parts.append(chunk.choices[0].text)
                    self.cond.notify_all()
        except BaseException as exc:  # asserted by the test
            self.error = exc

    def wait_chunks(self, n: int, timeout_s: float = 120) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.parts) >= n, timeout_s), "the request made no progress"

    def text(self, timeout_s: float = 240) -> str:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the request hung"
        assert self.error is None, repr(self.error)
        return "".join(self.parts)


def test_a_worker_killed_from_the_page_is_replaced_while_a_request_streams_exactly(redis_url, model, tmp_path):
    chromium = _chromium()
    from playwright.sync_api import expect, sync_playwright

    reference = Reference(model).text(PROMPT, MAX_TOKENS, ignore_eos=True)
    key_file = tmp_path / "admin.env"
    settings = cluster_settings(
        redis_url,
        model,
        prompt_depth=1,
        token_depth=2,
        prompt_microbatch=2,
        token_microbatch=2,
        controller={
            "api_keys": [SecretStr(API_KEY), SecretStr(ADMIN_KEY)],
            "admin_key_ids": [key_id(ADMIN_KEY)],
            "admin_signing_key_file": key_file,
        },
    )
    write_private(key_file, f"DEJAVU_ADMIN__SIGNING_KEY={settings.admin.signing_key.get_secret_value()}\n")
    with running(settings, spares=1) as launcher, sync_playwright() as playwright:
        url = launcher.api_url + "/dashboard"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 403
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            context = browser.new_context(http_credentials={"username": "admin", "password": ADMIN_KEY})
            page = context.new_page()
            page.on("dialog", lambda dialog: dialog.accept())  # "Really kill t1?"
            page.goto(url)
            expect(page.locator("#connection")).to_have_text("live", timeout=TIMEOUT_MS)
            expect(page.locator('[data-stage="prompt-0"] .holder')).to_have_text("p0", timeout=TIMEOUT_MS)
            expect(page.locator('[data-stage="token-0"] .holder')).to_have_text("t0")
            expect(page.locator('[data-stage="token-1"] .holder')).to_have_text("t1")
            expect(page.locator('[data-spare="spare0"]')).to_be_visible()
            expect(page.locator("#status")).to_have_text("ready")
            first_epoch = int(page.text_content("#epoch"))

            stream = Stream(launcher.api_url, settings.model.name)
            stream.wait_chunks(4)
            expect(page.locator('#requests tr[data-status="decoding"]')).to_have_count(1, timeout=TIMEOUT_MS)
            page.click('tr[data-worker="t1"] button[data-action="kill"]')
            expect(page.locator("#action-result")).to_have_attribute("data-outcome", "sent", timeout=TIMEOUT_MS)

            expect(page.locator('[data-stage="token-1"] .holder')).to_have_text("spare0", timeout=TIMEOUT_MS)
            page.wait_for_function(
                f"Number(document.getElementById('epoch').textContent) > {first_epoch}", timeout=TIMEOUT_MS
            )
            expect(page.locator("[data-repair-state]")).to_have_attribute(
                "data-repair-state", "done", timeout=TIMEOUT_MS
            )
            events = page.locator("#events").inner_text()
            assert "kill sent to t1" in events and "token 1 t1 -> spare0" in events, events
            text = stream.text()
            assert text == reference, f"{text!r} != {reference!r}\n{logs(launcher)}"
            assert launcher.child("t1").proc.wait(timeout=30) != 0  # it was killed, not drained

            snapshot = httpx.get(url + "/snapshot", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
            repair = snapshot["repair"]
            assert repair["replaced"] == {"1": "spare0"} and repair["state"] == "done"
            assert repair["resumable"] or repair["rerun"], "the request was not in flight through the repair"
        finally:
            browser.close()
