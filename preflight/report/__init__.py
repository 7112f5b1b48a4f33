"""Reports over one stream of Results: the terminal and the JSON document (render), the JUnit, Prometheus and
HTML files (files), and the redaction every output goes through first (redact)."""
