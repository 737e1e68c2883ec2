#!/usr/bin/env python3
"""A fake cloud metadata service on loopback, for testing scripts/spot-run.sh.

Serves the spot/preemption endpoints of AWS (IMDSv2: a token is required),
GCP, Azure and Alibaba Cloud. The termination notice appears once the file
given by --trigger exists. With --creds FILE it also serves an EC2 instance
role's credentials (iam/security-credentials/, then /ROLE), and a
container's at /v1/credentials (Authorization checked against FILE's "auth"
when it has one), as FILE, a JSON
object read at each request, says: {"role", "AccessKeyId",
"SecretAccessKey", "Token", "expires_in" (seconds from now), "delay_s" (the
role's credentials answered that late, after the .fetches line)}, or {"raw":
TEXT} to answer TEXT instead, or {"status": CODE} to answer that; each
credentials request appends a line to FILE.fetches. Prints the port it
listens on, then serves until killed. Standard library only.

With --imdsv1 the token is refused (403, as a container past the hop limit
would see no answer) and the notice is served without one. With --other
PATH, while PATH exists Azure's Preempt event is for another VM of the set
(vm1; this one is vm0). With --maintenance PATH, while PATH exists GCP's
maintenance-event is TERMINATE_ON_HOST_MAINTENANCE (else NONE).

usage: fake_metadata.py [--trigger PATH] [--creds FILE] [--imdsv1] [--other PATH]
                        [--maintenance PATH] [--port 0]
"""
import argparse
import http.server
import json
import os
import sys
import time

TOKEN = "fake-imds-token"


def serve_creds(h, creds, path):
    """The instance role's endpoints under /latest/meta-data/iam/security-credentials/."""
    if h.headers.get("X-aws-ec2-metadata-token") != TOKEN:
        h.reply(401)
        return
    with open(creds) as f:
        c = json.load(f)
    name = path[len("/latest/meta-data/iam/security-credentials/"):]
    if "status" in c:
        h.reply(int(c["status"]))
    elif name == "":
        h.reply(200, (c.get("role", "spotune-role") + "\n").encode())
    elif name != c.get("role", "spotune-role"):
        h.reply(404)
    else:
        with open(creds + ".fetches", "a") as f:
            f.write(c.get("AccessKeyId", "") + "\n")
        time.sleep(float(c.get("delay_s", 0)))
        if "raw" in c:
            h.reply(200, c["raw"].encode(), "application/json")
            return
        exp = time.gmtime(time.time() + float(c.get("expires_in", 21600)))
        body = {"Code": "Success", "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "Type": "AWS-HMAC", "AccessKeyId": c["AccessKeyId"],
                "SecretAccessKey": c["SecretAccessKey"], "Token": c["Token"],
                "Expiration": time.strftime("%Y-%m-%dT%H:%M:%SZ", exp)}
        h.reply(200, json.dumps(body).encode(), "application/json")


def serve_container(h, creds):
    """A container's credentials endpoint (ECS, EKS Pod Identity): /v1/credentials,
    with Authorization equal to FILE's "auth" when it has one."""
    with open(creds) as f:
        c = json.load(f)
    if "auth" in c and h.headers.get("Authorization") != c["auth"]:
        h.reply(401)
        return
    with open(creds + ".fetches", "a") as f:
        f.write(c.get("AccessKeyId", "") + "\n")
    exp = time.gmtime(time.time() + float(c.get("expires_in", 21600)))
    body = {"AccessKeyId": c["AccessKeyId"], "SecretAccessKey": c["SecretAccessKey"],
            "Token": c["Token"], "Expiration": time.strftime("%Y-%m-%dT%H:%M:%SZ", exp)}
    h.reply(200, json.dumps(body).encode(), "application/json")


def make_handler(trigger, creds, imdsv1=False, other=None, maintenance=None):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, body=b"", ctype="text/plain"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self):
            if imdsv1:
                self.reply(403, b"Forbidden")
            elif self.path == "/latest/api/token" and \
                    self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                self.reply(200, TOKEN.encode())
            else:
                self.reply(400)

        def do_GET(self):
            noticed = trigger is not None and os.path.exists(trigger)
            p = self.path
            if creds and p.startswith("/latest/meta-data/iam/security-credentials/"):
                serve_creds(self, creds, p)
            elif creds and p == "/v1/credentials":
                serve_container(self, creds)
            elif p.startswith("/latest/meta-data/spot/instance-action"):
                if self.headers.get("X-aws-ec2-metadata-token") != TOKEN and not imdsv1:
                    self.reply(401)
                elif noticed:
                    body = json.dumps({"action": "terminate", "time": "2026-11-29T12:00:00Z"})
                    self.reply(200, body.encode(), "application/json")
                else:
                    self.reply(404)
            elif p.startswith("/computeMetadata/v1/instance/preempted"):
                if self.headers.get("Metadata-Flavor") != "Google":
                    self.reply(403)
                else:
                    self.reply(200, b"TRUE" if noticed else b"FALSE")
            elif p.startswith("/computeMetadata/v1/instance/maintenance-event"):
                if self.headers.get("Metadata-Flavor") != "Google":
                    self.reply(403)
                elif maintenance and os.path.exists(maintenance):
                    self.reply(200, b"TERMINATE_ON_HOST_MAINTENANCE")
                else:
                    self.reply(200, b"NONE")
            elif p.startswith("/metadata/instance/compute/name"):
                self.reply(200 if self.headers.get("Metadata") == "true" else 400, b"vm0")
            elif p.startswith("/metadata/scheduledevents"):
                if self.headers.get("Metadata") != "true":
                    self.reply(400)
                    return
                events = []
                if noticed:
                    events.append({"EventId": "1", "EventType": "Preempt",
                                   "ResourceType": "VirtualMachine",
                                   "Resources": ["vm1" if other and os.path.exists(other)
                                                 else "vm0"],
                                   "EventStatus": "Scheduled", "NotBefore": "Sun, 29 Nov 2026"})
                body = json.dumps({"DocumentIncarnation": 1, "Events": events})
                self.reply(200, body.encode(), "application/json")
            elif p.startswith("/latest/meta-data/instance/spot/termination-time"):
                if noticed:
                    self.reply(200, b"2026-11-29T12:00:00Z")
                else:
                    self.reply(404)
            else:
                self.reply(404)

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trigger")
    ap.add_argument("--creds")
    ap.add_argument("--imdsv1", action="store_true")
    ap.add_argument("--other")
    ap.add_argument("--maintenance")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    srv = http.server.ThreadingHTTPServer(
        ("127.0.0.1", args.port),
        make_handler(args.trigger, args.creds, args.imdsv1, args.other, args.maintenance))
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
