# On removal (not upgrade): stop and disable. The rules stay in the kernel.
if [ "$1" -eq 0 ]; then
    if [ -d /run/systemd/system ]; then
        systemctl disable --now nodeproxy.service >/dev/null 2>&1 || :
    fi
    cat <<'MSG'
nodeproxy: the service is stopped, but its nftables rules (tables "ip nodeproxy" and
"ip6 nodeproxy") stay in the kernel so Service traffic keeps flowing until another proxy takes
over. To remove them, run `nodeproxy --cleanup` now, before the package is gone, or afterwards
`nft delete table ip nodeproxy; nft delete table ip6 nodeproxy`.
MSG
fi
