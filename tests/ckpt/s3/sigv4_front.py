#!/usr/bin/env python3
"""A signature-verifying front for s3rver, for the checkpoint tests.

s3rver stores objects but checks no signatures, so a client that signs wrongly passes against
it. This front listens on 127.0.0.1:PORT, recomputes the AWS Signature V4 of every request
from what was actually received (the method, path and query as sent, the values of the
headers named in SignedHeaders as sent, the body's SHA-256) with botocore's S3 signer, AWS's
own code, and forwards only requests whose signature matches to s3rver on 127.0.0.1:UPSTREAM.
Otherwise it answers as S3 does, with an XML error:
  403 SignatureDoesNotMatch   the signature differs (the body holds the canonical request and
                              string to sign computed here)
  403 InvalidAccessKeyId      another access key
  403 AccessDenied            no Authorization header, or an x-amz-* header sent unsigned
  400 AuthorizationHeaderMalformed, XAmzContentSHA256Mismatch, InvalidRequest
  503 ServiceUnavailable      s3rver does not answer

    sigv4_front.py --port P --upstream-port U --access-key AK --secret-key SK [--region R]

MOE_TEST_S3_VERBOSE=1 logs every request and its verdict on stderr.
"""
import argparse
import hashlib
import http.client
import http.server
import os
import re
import sys
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

HOP_BY_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "te", "upgrade",
              "proxy-connection", "proxy-authorization", "trailer"}
AUTHZ = re.compile(r"^AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request,"
                   r"\s*SignedHeaders=([a-z0-9;-]+),\s*Signature=([0-9a-f]{64})$")
VERBOSE = bool(os.environ.get("MOE_TEST_S3_VERBOSE"))


class S3Error(Exception):
    def __init__(self, status, code, message, **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def expected_signature(args, method, path, headers, signed, payload_hash, amz_date):
    """botocore's signature of the request as received; headers: the received (name, value)
    pairs, of which those named in `signed` are signed."""
    request = AWSRequest(method=method, url="http://" + headers_get(headers, "host") + path)
    for name, value in headers:
        if name.lower() in signed:
            request.headers.add_header(name, value)
    request.context["timestamp"] = amz_date
    auth = S3SigV4Auth(Credentials(args.access_key, args.secret_key), "s3", args.region)
    creq = auth.canonical_request(request)
    sts = auth.string_to_sign(request, creq)
    return auth.signature(sts, request), creq, sts


def headers_get(headers, name):
    values = [v for n, v in headers if n.lower() == name]
    return values[0] if values else None


def verify(args, method, path, headers, body):
    authz = headers_get(headers, "authorization")
    if authz is None:
        raise S3Error(403, "AccessDenied", "Anonymous access is refused by this test front.")
    m = AUTHZ.match(authz.strip())
    if not m:
        raise S3Error(400, "AuthorizationHeaderMalformed",
                      "The authorization header is malformed: " + authz[:120])
    key, date, region, service, signed_list, signature = m.groups()
    if key != args.access_key:
        raise S3Error(403, "InvalidAccessKeyId",
                      "The AWS Access Key Id you provided does not exist in our records.")
    if region != args.region or service != "s3":
        raise S3Error(400, "AuthorizationHeaderMalformed",
                      f"The authorization header is malformed; the region '{region}' or the "
                      f"service '{service}' is wrong; expecting '{args.region}' and 's3'")
    amz_date = headers_get(headers, "x-amz-date")
    if not amz_date or amz_date[:8] != date:
        raise S3Error(403, "AccessDenied", "x-amz-date is missing or not the credential's date")
    signed = set(signed_list.split(";"))
    unsigned = sorted({n.lower() for n, _ in headers
                       if n.lower().startswith("x-amz-") and n.lower() not in signed})
    if "host" not in signed or unsigned:
        raise S3Error(403, "AccessDenied", "There were headers present in the request which "
                      "were not signed", HeadersNotSigned=", ".join(unsigned or ["host"]))
    payload_hash = headers_get(headers, "x-amz-content-sha256")
    if payload_hash is None:
        raise S3Error(400, "InvalidRequest",
                      "Missing required header for this request: x-amz-content-sha256")
    if payload_hash != "UNSIGNED-PAYLOAD" and payload_hash != hashlib.sha256(body).hexdigest():
        raise S3Error(400, "XAmzContentSHA256Mismatch", "The provided 'x-amz-content-sha256' "
                      "header does not match what was computed.")
    want, creq, sts = expected_signature(args, method, path, headers, signed, payload_hash,
                                         amz_date)
    if want != signature:
        raise S3Error(403, "SignatureDoesNotMatch", "The request signature we calculated does "
                      "not match the signature you provided. Check your key and signing method.",
                      CanonicalRequest=creq, StringToSign=sts, SignatureProvided=signature)


class Front(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue answered before the body

    def log_message(self, fmt, *a):
        if VERBOSE:
            sys.stderr.write("sigv4-front: " + fmt % a + "\n")

    def handle_any(self):
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding"):
            return self.fail(S3Error(411, "MissingContentLength",
                                     "You must provide the Content-Length HTTP header."))
        body = self.rfile.read(length) if length else b""
        headers = list(self.headers.items())
        try:
            verify(self.server.args, self.command, self.path, headers, body)
        except S3Error as e:
            if VERBOSE:
                sys.stderr.write(f"sigv4-front: {self.command} {self.path}: {e.code}\n")
            return self.fail(e)
        self.forward(headers, body)

    def forward(self, headers, body):
        up = http.client.HTTPConnection("127.0.0.1", self.server.args.upstream_port, timeout=120)
        try:
            fwd = {n: v for n, v in headers if n.lower() not in HOP_BY_HOP}
            fwd["Content-Length"] = str(len(body))
            up.request(self.command, self.path, body=body, headers=fwd)
            resp = up.getresponse()
            data = resp.read()
        except OSError as e:
            return self.fail(S3Error(503, "ServiceUnavailable", f"s3rver: {e}"))
        finally:
            up.close()
        self.send_response(resp.status, resp.reason)
        length = None
        for name, value in resp.getheaders():
            if name.lower() == "content-length":
                length = value
            elif name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        # a HEAD answer keeps the object's length; other answers carry the body read here
        self.send_header("Content-Length",
                         length if self.command == "HEAD" and length else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def fail(self, e):
        extra = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in e.extra.items())
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{e.code}</Code>'
               f"<Message>{escape(e.message)}</Message>{extra}"
               f"<Resource>{escape(urlsplit(self.path).path)}</Resource></Error>").encode()
        self.send_response(e.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_any


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # a client killed mid-request (the crash tests do that) is no error of the front
        if VERBOSE or not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument("--access-key", required=True)
    p.add_argument("--secret-key", required=True)
    p.add_argument("--region", default="us-east-1")
    args = p.parse_args()
    server = Server(("127.0.0.1", args.port), Front)
    server.args = args
    server.serve_forever()


if __name__ == "__main__":
    main()
