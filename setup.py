"""Install dapo_ref, reading every setting from settings.ini (the nbdev way)."""
from configparser import ConfigParser
import setuptools, shlex

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

expected = ('version description keywords author author_email lib_name user '
            'license status min_python audience language').split()
for o in expected: assert o in cfg, f"missing expected setting: {o}"

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable',
            '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12'.split()

requirements = shlex.split(cfg.get('requirements', ''))
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
scale_requirements = shlex.split(cfg.get('scale_requirements', ''))
trackers = {t: shlex.split(cfg.get(f'{t}_requirements', '')) for t in ('tensorboard', 'wandb')}  # report_to's backends
lic = licenses[cfg['license'].lower()]
min_python = cfg['min_python']
lib_path = cfg['lib_path']
console_scripts = [s.strip() for s in cfg.get('console_scripts', '').splitlines() if s.strip()]

setuptools.setup(
    name=cfg['lib_name'],
    license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'License :: ' + lic[1],
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + o
                   for o in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=[lib_path, lib_path + '.*']) + [lib_path + '.recipes'],
    package_dir={lib_path + '.recipes': 'recipes'},  # recipes/*.yaml ship inside the package as dapo_ref/recipes/
    include_package_data=True,
    package_data={lib_path: ['tiny_model/*',            # the shipped warm-started tiny model (dapo_ref.tiny)
                            'testbeds/*/*'],          # the shipped testbed policies (dapo_ref.testbeds.ship_testbeds)
                  lib_path + '.recipes': ['*.yaml']},  # recipes/*.yaml, found by dapo_ref.core.find_recipe
    install_requires=requirements,
    extras_require={'dev': dev_requirements, 'scale': scale_requirements, **trackers},
    dependency_links=cfg.get('dep_links', '').split(),
    python_requires='>=' + cfg['min_python'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': console_scripts, 'nbdev': [f'{cfg["lib_path"]}={cfg["lib_path"]}._modidx:d']},
    version=cfg['version'],
    author=cfg['author'], author_email=cfg['author_email'],
    description=cfg['description'], keywords=cfg['keywords'],
)
