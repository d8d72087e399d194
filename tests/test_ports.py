"""course.find_free_ports draws outside the range the OS hands out by itself, as Linux says it in
ip_local_port_range, not only outside its default 32768-60999 (issue 32, item 4). In-process."""
import io

import pytest

import course


@pytest.mark.parametrize("line, low, high", [("32768\t60999\n", 20000, 32767),  # the default
                                             ("40000\t60999\n", 27232, 39999),  # moved up
                                             ("1024\t50000\n", 50001, 65535),  # widened down: above
                                             ("1024\t65535\n", 20000, 32767)])  # every port: the race
def test_free_ports_come_from_outside_the_oss_own_range(monkeypatch, line, low, high):
    real = open
    monkeypatch.setattr(course, "open", lambda path, *a, **k: io.StringIO(line)
                        if "ip_local_port_range" in str(path) else real(path, *a, **k), raising=False)
    ports = course.find_free_ports(40)
    assert len(set(ports)) == 40 and all(low <= p <= high for p in ports), (line, sorted(ports))
