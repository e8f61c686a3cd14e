# shellcheck shell=bash
# Shared by hack/envtest-assets and hack/node (sourced, not run): Kubernetes built offline from Debian
# bookworm's `kubernetes` source package, the one route to its binaries that works where only Debian's
# package mirror is reachable (no registry ships kube-apiserver, kind or envtest archives there).
#
# The source tree, patched once, is kept with its Go build cache under KUBE_SRC_DIR (about 3 GB), so the
# node's binaries reuse the packages compiled for envtest's kube-apiserver and a second build is a copy.
# Every function logs to stderr (stdout is the scripts' answer) and fails with one line.

KUBE_VERSION=1.20.2
CACHE_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}
KUBE_SRC_DIR=${KUBE_SRC_DIR:-$CACHE_ROOT/kubernetes-debian/$KUBE_VERSION}
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive

log() { echo "[$(date +%T)] ${0##*/}: $*" >&2; }
die() { echo "${0##*/}: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root ($1)"; }

# The packages not yet installed among "$@", installed from Debian (lists refreshed first, as they may be stale).
apt_install() {
    command -v apt-get >/dev/null || die "no apt-get: these scripts build from Debian's packages"
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} = 0 ] && return 0
    [ -z "$SUDO" ] || command -v sudo >/dev/null ||
        die "not root and no sudo: as root, apt-get install ${missing[*]}"
    log "apt-get install ${missing[*]}"
    $SUDO apt-get update -qq >&2
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The Debian mirror the machine already uses (DEBIAN_MIRROR overrides): the first non-security URI of an
# enabled deb source, in the deb822 (*.sources) or the one-line (*.list) format.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
        awk '/^URIs:/{for (i = 2; i <= NF; i++) if ($i !~ /security/) {print $i; exit}}')
    [ -n "$uri" ] || uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
        awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\// && $i !~ /security/) {print $i; exit}}')
    [ -n "$uri" ] || die "no Debian mirror in the apt sources (/etc/apt/sources.list*): set DEBIAN_MIRROR"
    echo "$uri"
}

# A deb-src entry for bookworm main, so that `apt-get source kubernetes` finds 1.20 (the machine's own
# sources usually list binary packages only). Skipped when some source already offers it.
ensure_kube_deb_src() {
    apt-cache showsrc kubernetes 2>/dev/null | grep -q "^Version: ${KUBE_VERSION%.*}\." && return 0
    local mirror
    mirror=$(debian_mirror)
    log "adding bookworm's source packages from $mirror to the apt sources"
    printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: %s\n' \
        "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg |
        $SUDO tee /etc/apt/sources.list.d/kubernetes-debian-src.sources >/dev/null
    $SUDO apt-get update -qq >&2
    apt-cache showsrc kubernetes 2>/dev/null | grep -q "^Version: ${KUBE_VERSION%.*}\." ||
        die "$mirror offers no kubernetes ${KUBE_VERSION%.*} source package (bookworm has it)"
}

# The unpacked, patched source tree (made once; a half-made one is never left in place).
kube_source() {
    local tree=$KUBE_SRC_DIR/kubernetes-$KUBE_VERSION
    [ -f "$tree/.prepared" ] && { echo "$tree"; return 0; }
    ensure_kube_deb_src
    local work
    work=$(mktemp -d "$KUBE_SRC_DIR/unpack.XXXXXX")
    log "fetching and unpacking Debian's kubernetes $KUBE_VERSION source"
    (cd "$work" && apt-get source --download-only -qq kubernetes >&2 && tar xzf kubernetes_*.orig.tar.gz)
    local src=$work/kubernetes-$KUBE_VERSION
    # The vendored reflect2 1.0.1 crashes under Go >= 1.18 ("fatal error: fault" on the first write of a
    # custom object): Debian's reflect2 1.0.2 and json-iterator 1.1.12 replace the vendored copies.
    local d
    for d in github.com/modern-go/reflect2 github.com/json-iterator/go; do
        rm -rf "${src:?}/vendor/$d" && mkdir -p "$src/vendor/$d"
        find "/usr/share/gocode/src/$d" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) \
            ! -name '*_test.go' -exec cp {} "$src/vendor/$d/" \;
    done
    # A source package has no .git: the version the binaries report comes from this file (the commit is
    # upstream's tag v1.20.2).
    cat >"$src/version.env" <<EOF
KUBE_GIT_COMMIT='faecb196815e248d3ecfb03c680a4507229c2a56'
KUBE_GIT_TREE_STATE='clean'
KUBE_GIT_VERSION='v$KUBE_VERSION'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
EOF
    touch "$src/.prepared"
    rm -rf "$tree" && mv "$src" "$tree" && rm -rf "$work"
    echo "$tree"
}

# One user of the source tree at a time (two checkouts' `make test` may build at once): held on fd 9 until
# the script ends.
kube_lock() {
    mkdir -p "$KUBE_SRC_DIR"
    exec 9>"$KUBE_SRC_DIR/.lock"
    flock -n 9 || { log "waiting for another build of $KUBE_SRC_DIR"; flock 9; }
}

# kube_build DEST NAME...: the binaries NAME (cmd/NAME of Kubernetes) in DEST, built where missing.
kube_build() {
    local dest=$1 name missing=()
    shift
    for name in "$@"; do [ -x "$dest/$name" ] || missing+=("$name"); done
    [ ${#missing[@]} = 0 ] && return 0
    mkdir -p "$dest"
    kube_lock
    apt_install golang-go make rsync golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
    local tree out targets=()
    tree=$(kube_source)
    out=$tree/_output/local/bin/$(go env GOOS)/$(go env GOARCH)
    for name in "${missing[@]}"; do [ -x "$out/$name" ] || targets+=("cmd/$name"); done
    if [ ${#targets[@]} -gt 0 ]; then
        local t0=$SECONDS
        log "building ${targets[*]} (GOPATH mode, vendored, offline: minutes; log in $KUBE_SRC_DIR/make.log)"
        (cd "$tree" && env -u GOPATH GO111MODULE=off GOPROXY=off GOFLAGS= KUBE_GIT_VERSION_FILE="$tree/version.env" \
            make WHAT="${targets[*]}") >"$KUBE_SRC_DIR/make.log" 2>&1 ||
            { tail -n 20 "$KUBE_SRC_DIR/make.log" >&2; die "make WHAT=\"${targets[*]}\" failed: $KUBE_SRC_DIR/make.log"; }
        log "built in $((SECONDS - t0)) s"
    fi
    for name in "${missing[@]}"; do   # copied then renamed: DEST never holds a partial binary
        cp "$out/$name" "$dest/.$name.tmp" && mv "$dest/.$name.tmp" "$dest/$name"
    done
}
