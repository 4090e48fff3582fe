"""Real servers started by the tests: a Hub-protocol HTTP server, the fake-gcs-server binary and moto's S3."""
