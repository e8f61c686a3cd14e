#!/bin/sh
# The base of the images built without a container registry: a minimal Debian with Python, made from
# Debian's packages with debootstrap and imported into podman. Skipped when the image exists.
#   images/base.sh IMAGE [MIRROR]     (as root: debootstrap, and the image store the builds use)
set -eu
image=${1:?usage: images/base.sh IMAGE [MIRROR]}
mirror=${2:-http://deb.debian.org/debian}
suite=bookworm  # Python 3.11, the version the production images use

if podman image exists "$image"; then
    exit 0
fi
if ! command -v debootstrap >/dev/null; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    "$suite" "$rootfs" "$mirror" >/dev/null
# What an image needs no copy of: the package lists (a build step fetches its own), docs, logs.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*
# The environment a registry's Python image sets (a Dockerfile's `ENV PATH=...:$PATH` extends it).
tar -C "$rootfs" -c . | podman import --quiet --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$image" >/dev/null
echo "built $image"
