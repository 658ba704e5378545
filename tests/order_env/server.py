"""An order-support tool server, for the second environment of the tests.

It stands for a user's own tool server: a separate process that imports nothing from
the project and speaks OpenAI's Agent RFT tool wire format (`POST /tools/<name>` with a
`function_call` body, answered with a `function_call_output`), standard library only.

    python tests/order_env/server.py --orders orders.json --port 8711

Tools: `lookup_order` (`{"order_id"}`: the order's item, price, days since delivery and
condition; 404 for an unknown order) and `refund_policy` (`{}`: the policy text).
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

POLICY = (
    "Refund policy: damaged on arrival: full refund at any time. Unopened: full refund within 30 days of "
    "delivery. Opened: half the price within 14 days of delivery. Otherwise no refund."
)


def handler(orders: dict[str, dict]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"ok": True}) if self.path == "/health" else self._send(404, {"detail": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            name = self.path.removeprefix("/tools/")
            arguments = json.loads(body.get("arguments") or "{}")
            if name == "lookup_order":
                order = orders.get(str(arguments.get("order_id")))
                if order is None:
                    self._send(404, {"detail": f"no order {arguments.get('order_id')!r}"})
                    return
                output = json.dumps(order, sort_keys=True)
            elif name == "refund_policy":
                output = POLICY
            else:
                self._send(404, {"detail": f"unknown tool {name!r}"})
                return
            self._send(200, {"type": "function_call_output", "call_id": body.get("call_id"), "id": body.get("id"),
                             "output": output})

    return Handler


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with open(args.orders, encoding="utf-8") as handle:
        table = json.load(handle)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(table))
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
