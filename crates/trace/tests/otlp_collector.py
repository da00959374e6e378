"""An OTLP/HTTP trace collector for tests: decodes each POSTed body with the official
opentelemetry-proto definitions (ExportTraceServiceRequest) and prints one JSON line per span.

Usage: otlp_collector.py [PORT]. Prints {"port": N} first. Each span: {"service", "trace_id",
"span_id", "parent_span_id", "name", "kind", "start", "end", "attributes", "status_code",
"status_message", "flags"}; a body that does not decode prints {"decode_error": ...} and gets a 400.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


# Requests are served on threads of their own: one line at a time, whole.
out_lock = threading.Lock()


def emit(obj):
    with out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        req = ExportTraceServiceRequest()
        try:
            req.ParseFromString(body)
        except DecodeError as e:
            emit({"decode_error": str(e)})
            self.send_response(400)
            self.end_headers()
            return
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            emit({"decode_error": f"{self.path} {self.headers.get('content-type')}"})
        for rs in req.resource_spans:
            service = {kv.key: value(kv.value) for kv in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    emit({
                        "service": service,
                        "scope": ss.scope.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "attributes": {kv.key: value(kv.value) for kv in s.attributes},
                        "events": [e.name for e in s.events],
                        "status_code": s.status.code,
                        "status_message": s.status.message,
                        "flags": s.flags,
                    })
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0), Handler)
emit({"port": server.server_address[1]})
server.serve_forever()
