#!/bin/sh
# System packages the test suite needs beyond Python: PostgreSQL (the production instance's storage,
# ft_assets_tests/pg.py), Chromium (the UI test, driven by Playwright with Debian's browser; no
# `playwright install` download), buildah and debootstrap (the worker image test, ft_assets_tests/test_image.py:
# it builds deploy/image/Containerfile on a Debian base it bootstraps), and Slurm with munge and OpenSSH
# (the Slurm gpu pool's tests start a one-node cluster and an sshd on loopback in a temp folder,
# ft_assets_tests/slurmcluster.py; nothing is started here). Idempotent: installs only what is missing, runs
# `apt-get update` only when it installs, and says what it did. Debian/Ubuntu; root, or sudo when available.
set -eu

missing=""
# PostgreSQL: Debian keeps initdb/pg_ctl in /usr/lib/postgresql/<major>/bin, off PATH.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    missing="$missing postgresql"
fi
if ! command -v chromium >/dev/null 2>&1; then
    missing="$missing chromium"
fi
for tool in buildah debootstrap; do
    if ! command -v "$tool" >/dev/null 2>&1 && ! [ -x "/usr/sbin/$tool" ]; then
        missing="$missing $tool"
    fi
done
# Slurm 22.05 on Debian 12 (slurmctld, slurmd and the client commands), its munge authentication, and
# sshd + ssh for the launcher's login-node path (binary:package).
for binary in sbatch:slurm-wlm slurmctld:slurm-wlm munged:munge sshd:openssh-server ssh:openssh-client; do
    if ! command -v "${binary%%:*}" >/dev/null 2>&1 && [ ! -x "/usr/sbin/${binary%%:*}" ]; then
        case " $missing " in *" ${binary#*:} "*) ;; *) missing="$missing ${binary#*:}" ;; esac
    fi
done
# PostgreSQL refuses to run as root; the tests start it as the `postgres` user with runuser.
if [ "$(id -u)" = 0 ] && ! command -v runuser >/dev/null 2>&1; then
    missing="$missing util-linux"
fi

if [ -z "$missing" ]; then
    echo "install-system-deps: nothing to do (postgresql, chromium, buildah, debootstrap, slurm-wlm, munge, openssh present)"
    exit 0
fi

if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "install-system-deps: missing:$missing; run as root or install them with apt-get" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-deps: missing:$missing and no apt-get here; install them with your package manager" >&2
    exit 1
fi

echo "install-system-deps: installing$missing"
$SUDO apt-get update -q
# shellcheck disable=SC2086  # $missing is a list of package names
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
echo "install-system-deps: installed$missing"
