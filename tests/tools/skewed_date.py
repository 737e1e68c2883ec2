#!/usr/bin/env python3
"""An HTTP endpoint whose Date header is off by --skew seconds, for testing
spotune doctor's clock-skew check. Answers every request 403 (as an S3
endpoint does to an unsigned one) with that Date. Prints the port it listens
on, then serves until killed. Standard library only.

usage: skewed_date.py --skew SECONDS [--port 0]
"""
import argparse
import email.utils
import http.server
import sys
import time


def make_handler(skew):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def date_time_string(self, timestamp=None):
            return email.utils.formatdate(time.time() + skew, usegmt=True)

        def reply(self):
            body = b"<Error><Code>AccessDenied</Code></Error>"
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = reply

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skew", type=float, required=True)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.skew))
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
