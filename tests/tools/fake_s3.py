#!/usr/bin/env python3
"""A small S3 endpoint on loopback that keeps objects in memory, for testing
the lease's conditional writes (tests/test_lease.c). Signatures are not
checked. Path-style only: /BUCKET/KEY for GET, HEAD, PUT and DELETE.

--conditions says what a PUT's If-None-Match: * and If-Match: ETAG do:
  honour  as AWS S3 does: 412 PreconditionFailed when the object exists
          (If-None-Match) or its ETag differs (If-Match), 404 NoSuchKey when
          If-Match finds no object;
  ignore  nothing (the PUT replaces the object), as some stores do;
  501     501 NotImplemented, as OpenStack Swift's s3api answers.
--slow-get SUFFIX:SECONDS holds the answer to a GET of a key ending in
SUFFIX that long, after taking the object as it is when the request comes
(so a PUT can land between the read and its answer).
--log FILE appends "METHOD KEY CONDITION" for each request as it comes, and
"done METHOD KEY STATUS" as it is answered.

Prints the port it listens on, then serves until killed. Standard library
only.

usage: fake_s3.py [--conditions honour|ignore|501] [--slow-get SUFFIX:S]
                  [--log FILE] [--port 0]
"""
import argparse
import hashlib
import http.server
import sys
import threading
import time

OBJECTS = {}
LOCK = threading.Lock()


def error_xml(code, msg):
    return ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>%s</Code>"
            "<Message>%s</Message></Error>" % (code, msg)).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def note(self, line):
        if self.server.args.log:
            with LOCK, open(self.server.args.log, "a") as f:
                f.write(line + "\n")

    def reply(self, status, body=b"", etag=None, head=False):
        self.send_response(status)
        if etag:
            self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(body)))
        if status >= 300:
            self.send_header("Content-Type", "application/xml")
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self.note("done %s %s %d" % (self.command, self.path, status))

    def condition(self):
        inm = self.headers.get("If-None-Match")
        im = self.headers.get("If-Match")
        return ("If-None-Match:" + inm) if inm else ("If-Match:" + im) if im else "-"

    def do_GET(self, head=False):
        self.note("%s %s %s" % (self.command, self.path, self.condition()))
        with LOCK:
            obj = OBJECTS.get(self.path)
        slow = self.server.args.slow_get
        if slow and self.path.endswith(slow[0]):
            time.sleep(slow[1])
        if obj is None:
            self.reply(404, b"" if head else error_xml("NoSuchKey", "no such key"), head=head)
        else:
            self.reply(200, obj[0], obj[1], head)

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_DELETE(self):
        self.note("DELETE %s -" % self.path)
        with LOCK:
            OBJECTS.pop(self.path, None)
        self.reply(204)

    def do_PUT(self):
        cond = self.condition()
        self.note("PUT %s %s" % (self.path, cond))
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        mode = self.server.args.conditions
        if cond != "-" and mode == "501":
            self.reply(501, error_xml("NotImplemented", "Conditional object PUTs are not "
                                      "supported"))
            return
        with LOCK:
            have = OBJECTS.get(self.path)
            status = 200
            if mode == "honour" and cond.startswith("If-None-Match:") and have is not None:
                status = 412
            elif mode == "honour" and cond.startswith("If-Match:"):
                want = cond[len("If-Match:"):].strip()
                status = 404 if have is None else 412 if have[1] != want else 200
            if status == 200:
                # a version of its own, as S3's ETag of equal bodies put twice is
                # the same: the time makes each put's ETag differ
                etag = '"%s"' % hashlib.md5(body + str(time.time_ns()).encode()).hexdigest()
                OBJECTS[self.path] = (body, etag)
        if status == 412:
            self.reply(412, error_xml("PreconditionFailed", "At least one of the pre-conditions"
                                      " you specified did not hold"))
        elif status == 404:
            self.reply(404, error_xml("NoSuchKey", "no such key"))
        else:
            self.reply(200, b"", etag)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--conditions", choices=["honour", "ignore", "501"], default="honour")
    p.add_argument("--slow-get", default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.slow_get:
        suffix, seconds = args.slow_get.rsplit(":", 1)
        args.slow_get = (suffix, float(seconds))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.daemon_threads = True
    srv.args = args
    print(srv.server_address[1], flush=True)
    sys.stdout.flush()
    srv.serve_forever()


if __name__ == "__main__":
    main()
