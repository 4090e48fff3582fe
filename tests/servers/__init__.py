"""Real servers started by the tests: a Hub-protocol HTTP server and the fake-gcs-server binary."""
