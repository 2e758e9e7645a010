"""IngressAdmission: the ingress's admission control (autoscaler/admission.py) as a stage of a
backend's generation path.

Every generation request asks the AdmissionController first; a refused one becomes a 429 with
Retry-After before anything is sent to a replica (its stream is never opened). An admitted request
is watched until its first token, which is what the controller's queue and predicted wait are made
of; one without a first token after the policy's queue timeout is given up with a 503
`queue_timeout` and Retry-After, and its stream closed, so its replica aborts it. A backend sends
unary requests as streams through this stage for that reason: a unary reply would only show when
the whole answer was done, and a long answer would look like a long wait in the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from autoscaler.admission import AdmissionController, AdmissionPolicy, Ticket
from contracts.priority import Priority
from contracts.serving import GenerateRequest, GenerationChunk
from deployments.errors import APIError, overloaded
from deployments.metrics import AdmissionStats


class IngressAdmission:
    def __init__(self, policy: AdmissionPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.controller = AdmissionController(policy, clock)

    async def watch(self, request: GenerateRequest,
                    open_stream: Callable[[GenerateRequest], AsyncGenerator[GenerationChunk, None]]
                    ) -> AsyncGenerator[GenerationChunk, None]:
        """The chunks of `open_stream(request)`, opened only once the request is admitted."""
        ticket = self._admit(request)
        timeout_s = self.policy.queue_timeout_for(request.priority)
        deadline_s = ticket.admitted_s + timeout_s
        with ticket:
            stream = open_stream(request)
            try:
                while True:
                    try:
                        if ticket.waiting:
                            chunk = await asyncio.wait_for(stream.__anext__(), max(deadline_s - self.clock(), 0.0))
                        else:
                            chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    except (asyncio.TimeoutError, TimeoutError):
                        raise self._timed_out(ticket, timeout_s) from None
                    if chunk.token_ids:
                        ticket.first_token()
                    yield chunk
            finally:
                await stream.aclose()

    def stats(self) -> AdmissionStats:
        controller = self.controller
        return AdmissionStats(num_waiting={p: controller.num_waiting(p) for p in Priority},
                              num_shed={p: controller.num_shed(p) for p in Priority},
                              num_timed_out={p: controller.num_timed_out(p) for p in Priority},
                              predicted_wait_s=controller.predicted_wait_s())

    def _admit(self, request: GenerateRequest) -> Ticket:
        verdict, ticket = self.controller.admit(request.priority)
        if ticket is None:
            raise overloaded(f"the service is overloaded: {verdict.reason}; retry later", verdict.retry_after_s or 1.0)
        return ticket

    def _timed_out(self, ticket: Ticket, timeout_s: float) -> APIError:
        self.controller.timed_out(ticket)
        policy = self.policy
        retry_s = max(self.controller.predicted_wait_s(), policy.min_retry_after_s)
        return APIError(f"no first token within {timeout_s:g} s: the service is overloaded; retry later", 503,
                        "service_unavailable", None, "queue_timeout", min(retry_s, policy.max_retry_after_s))
