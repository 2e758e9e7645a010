"""The waiting queue: highest priority class first, first come first served within a class."""

from __future__ import annotations

from collections import deque

from model_worker.sched.request import Priority, Request


class RequestQueue:
    def __init__(self) -> None:
        self._classes: list[deque[Request]] = [deque() for _ in Priority]

    def push(self, request: Request) -> None:
        self._classes[request.priority].append(request)

    def push_front(self, request: Request) -> None:
        """A preempted request goes back to the head of its class: it arrived before the rest."""
        self._classes[request.priority].appendleft(request)

    def peek(self) -> Request | None:
        for queue in self._classes:
            if queue:
                return queue[0]
        return None

    def pop(self) -> Request:
        for queue in self._classes:
            if queue:
                return queue.popleft()
        raise IndexError("pop from an empty RequestQueue")

    def remove(self, request: Request) -> bool:
        try:
            self._classes[request.priority].remove(request)
        except ValueError:
            return False
        return True

    def count(self, priority: Priority) -> int:
        return len(self._classes[priority])

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._classes)

    def __bool__(self) -> bool:
        return any(self._classes)

    def __iter__(self):
        for queue in self._classes:
            yield from queue
