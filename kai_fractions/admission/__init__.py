"""The admission webhooks (validating and mutating) and their HTTPS server.

`validate.validate` and `mutate.mutate` are pure functions from an AdmissionReview v1 request
to a `review.Decision`; `server` serves them over HTTPS with certificate reload (`tls`);
`config.AdmissionConfig` holds the flags. See docs/admission.md.

Nothing is imported here on purpose: the CLI reads `config` to build its parser, and every
command (the gate's included) pays for what this package imports.
"""
